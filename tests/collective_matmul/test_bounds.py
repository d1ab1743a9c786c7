"""The bounds' arithmetic and words (collective_matmul/wire/bounds.py), and the records that carry them."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.wire import BoundsMeasurement, ConfirmResult, Measurement, ResultIn, Timing
from collective_matmul.wire.bounds import Bounds, StepBound, hidden_fraction, reason, step_bound, times_bound, verdict
from collective_matmul.wire.bundle import Bundle, TunedConfig

MS = 1e-3
PROBLEM = Problem.parse("matmul_reduce_scatter:2048x2048x1024:float32:8")
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
RING = Decomposition(method="ring", direction="bidirectional", chunks=2)

# the issue's numbers: the local matmul 45 ms, the reduce-scatter 28.5 ms, the baseline 77.5 ms, the best ring 69.5
ISSUE = Bounds(45 * MS, 28.5 * MS, 77.5 * MS)


def config(decomposition=RING, time_s=69.5 * MS, baseline_s=77.5 * MS, bounds: Bounds | None = ISSUE,
           problem=PROBLEM) -> TunedConfig:
    fields = {} if bounds is None else dict(compute_s=bounds.compute_s, communication_s=bounds.communication_s,
                                            bounds_baseline_s=bounds.baseline_s)
    return TunedConfig(problem=problem, hardware=HW, decomposition=decomposition, time_s=time_s,
                       baseline_s=baseline_s, speedup=baseline_s / time_s, **fields)


# --- the arithmetic ---------------------------------------------------------------------------


def test_the_issues_ring_hides_a_quarter_of_the_hideable_time_at_1_54x_the_bound():
    assert ISSUE.bound_s == 45 * MS and ISSUE.sum_s == pytest.approx(73.5 * MS)
    ratio = 69.5 / 77.5
    assert hidden_fraction(ISSUE, ratio, ring=True) == pytest.approx((77.5 - 69.5) / (77.5 - 45))
    assert times_bound(ISSUE, ratio) == pytest.approx(69.5 / 45)
    assert verdict(ISSUE, ratio, ring=True).startswith("hides 25% of the hideable time; 1.54x the bound")


def test_the_fraction_is_each_time_against_its_own_rounds_baseline():
    """A machine 10% slower in the bounds rounds: the same fraction (the DESIGN formula would drift)."""
    drifted = Bounds(45 * MS * 1.1, 28.5 * MS * 1.1, 77.5 * MS * 1.1)
    ratio = 69.5 / 77.5
    assert hidden_fraction(drifted, ratio, ring=True) == pytest.approx(hidden_fraction(ISSUE, ratio, ring=True))
    naive = (77.5 - 69.5) / (77.5 - 45 * 1.1)  # baseline - tuned over baseline - bound, across the two rounds
    assert hidden_fraction(drifted, ratio, ring=True) != pytest.approx(naive)


def test_a_baseline_winner_hides_nothing_and_a_slow_ring_is_negative_not_clamped():
    assert hidden_fraction(ISSUE, 1.0, ring=False) == 0.0
    slow = hidden_fraction(ISSUE, 1.02, ring=True)
    assert slow == pytest.approx(-0.02 / (1 - 45 / 77.5)) and slow < 0
    fast = hidden_fraction(ISSUE, 0.5, ring=True)  # beat the measured bound: above 1, as measured
    assert fast > 1


def test_nothing_to_hide_and_no_bounds_have_no_fraction():
    assert hidden_fraction(None, 0.9, ring=True) is None
    assert hidden_fraction(Bounds(50 * MS, 1 * MS, 52 * MS), 0.9, ring=True) is None  # the collective: 2%
    assert hidden_fraction(Bounds(45 * MS, 30 * MS, 46 * MS), 0.9, ring=True) is None  # the baseline at the bound


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="compute_s must be above 0"):
        Bounds(0.0, 1.0, 1.0)


# --- the words --------------------------------------------------------------------------------


def test_no_bounds_measured():
    assert reason(None).startswith("no bounds were measured")
    assert "0.90x" in reason(None, best_ring_ratio=1 / 0.9)


def test_nothing_to_hide_when_the_collective_is_a_few_percent_of_the_baseline():
    words = reason(Bounds(50 * MS, 1.5 * MS, 52 * MS))
    assert words.startswith("nothing to hide: the collective alone takes 1.5 ms, 3% of the baseline's 52 ms")


def test_the_baseline_already_at_the_bound_overlaps_already():
    words = reason(Bounds(45 * MS, 30 * MS, 46 * MS))
    assert words.startswith("the baseline (46 ms) already sits at the bound max(compute 45 ms, communication 30 ms)")
    assert "already overlaps" in words and "their sum is 75 ms" in words


def test_a_baseline_under_the_bound_measured_beside_it_is_not_called_overlap():
    words = reason(Bounds(20 * MS, 1 * MS, 5 * MS))
    assert words.startswith("the baseline (5 ms) ran faster than the bound measured beside it (20 ms)")
    assert hidden_fraction(Bounds(20 * MS, 1 * MS, 5 * MS), 0.9, ring=True) is None


def test_the_baseline_at_the_bound_because_the_matmul_is_tiny():
    words = reason(Bounds(1 * MS, 45 * MS, 46 * MS))
    assert "already sits at the bound" in words and "the matmul alone takes only 1 ms" in words


def test_communication_bound():
    words = reason(Bounds(20 * MS, 40 * MS, 60 * MS), best_ring_ratio=1.1)
    assert words.startswith("communication-bound: the collective alone (40 ms) takes at least as long as the matmul "
                            "alone (20 ms)")
    assert "the link time stays" in words and "0.91x" in words


def test_the_rings_steps_cost_more_than_the_transfer_they_hide():
    words = reason(Bounds(45 * MS, 28 * MS, 75 * MS), best_ring_ratio=1 / 0.95)
    assert words.startswith("the ring's steps cost more than the transfer they hide")
    assert "is about compute + communication (73 ms): nothing in it overlaps" in words
    assert "30 ms (40%) could be hidden" in words and "0.95x" in words
    partly = reason(Bounds(45 * MS, 28 * MS, 60 * MS))  # the baseline overlaps a part already
    assert partly.startswith("the ring's steps cost more") and "nothing in it overlaps" not in partly


def test_a_winning_ring_with_little_to_hide_or_no_bounds_says_so():
    assert "little to hide" in verdict(Bounds(45 * MS, 30 * MS, 46 * MS), 0.97, ring=True)
    assert verdict(None, 0.8, ring=True) == "1.25x the baseline's speed; no bounds were measured"
    # a ring faster than the bound (over gloo its permutes beat XLA's reduce-scatter, which the bound times)
    beyond = verdict(Bounds(4.7 * MS, 37.4 * MS, 40 * MS), 25.5 / 40, ring=True)
    assert beyond.startswith("1.57x the baseline's speed, 0.68x the bound: faster than the matmul or the collective")
    assert beyond.endswith("hidden fraction 558%")
    assert verdict(ISSUE, 1.0, ring=False) == reason(ISSUE)


# --- the tuned config and the bundle ----------------------------------------------------------


def test_a_tuned_config_derives_its_bound_fraction_and_reason():
    c = config()
    assert c.bounds == ISSUE and c.bound_s == 45 * MS
    assert c.hidden_fraction == pytest.approx(8 / 32.5)
    assert c.reason.startswith("hides 25% of the hideable time")
    base = config(Decomposition.baseline(), time_s=77.5 * MS)
    assert base.hidden_fraction == 0.0 and base.reason.startswith("the ring's steps cost more")
    bare = config(bounds=None)
    assert bare.bounds is None and bare.bound_s is None and bare.hidden_fraction is None
    assert "no bounds were measured" in bare.reason


def test_bounds_are_all_three_or_none():
    with pytest.raises(ValidationError, match="give all three bounds"):
        TunedConfig(problem=PROBLEM, hardware=HW, decomposition=RING, time_s=1.0, baseline_s=1.0, speedup=1.0,
                    compute_s=0.5)
    with pytest.raises(ValidationError):
        config(bounds=None).model_validate({**config().model_dump(), "compute_s": -1.0})


def test_a_dump_shows_the_derived_values_and_loads_back_recomputing_them(tmp_path):
    c = config()
    dumped = json.loads(c.model_dump_json())
    assert dumped["bound_s"] == 45 * MS and dumped["hidden_fraction"] == pytest.approx(c.hidden_fraction)
    assert dumped["reason"] == c.reason and dumped["compute_s"] == 45 * MS
    assert TunedConfig.model_validate(dumped) == c
    forged = {**dumped, "hidden_fraction": 0.99, "reason": "perfect"}  # derived: computed again, never believed
    assert TunedConfig.model_validate(forged).hidden_fraction == pytest.approx(c.hidden_fraction)
    bundle = Bundle()
    bundle.add(c)
    bundle.add(config(bounds=None, problem=Problem.parse("ag:256x64x128:float32:8")))
    bundle.save(tmp_path / "b.json")
    loaded = Bundle.load(tmp_path / "b.json")
    assert loaded.configs == bundle.configs and loaded.configs[0].communication_s == 28.5 * MS
    assert loaded.configs[1].bounds is None


def test_the_public_schema_names_the_bounds():
    schema = TunedConfig.model_json_schema(mode="serialization")["properties"]
    assert {"compute_s", "communication_s", "bounds_baseline_s", "bound_s", "hidden_fraction", "reason"} <= set(schema)


# --- the step's own bound ---------------------------------------------------------------------


def test_the_step_bound_sums_each_ops_bound_against_the_measured_step():
    ag = config(problem=Problem.parse("ag:2048x1024x2048:float32:8"), time_s=9 * MS, baseline_s=10 * MS,
                bounds=Bounds(6 * MS, 3 * MS, 10 * MS))  # hideable: 4 ms per run
    rs = config()  # saves 8 ms, hideable 32.5 ms per run
    sb = step_bound([(2, ag), (1, rs)], measured_baseline_s=200 * MS, measured_tuned_s=190 * MS)
    assert sb.estimated_saved_s == pytest.approx(2 * 1 * MS + 8 * MS)
    assert sb.hideable_s == pytest.approx(2 * 4 * MS + 32.5 * MS)
    assert sb.measured_saved_s == pytest.approx(10 * MS)
    assert sb.overlap_perfect_s == pytest.approx(200 * MS - 40.5 * MS)
    assert sb.reached == pytest.approx(10 / 40.5)
    assert [t.count for t in sb.terms] == [2, 1] and sb.terms[0].bound_s == pytest.approx(6 * MS)
    assert "from overlap-perfect" in sb.summary and "agree" in sb.summary
    assert StepBound.model_validate_json(sb.model_dump_json()) == sb


def test_the_step_bound_uses_each_ops_round_and_never_saves_below_zero():
    drifted = config(time_s=9 * MS, baseline_s=10 * MS, bounds=Bounds(12 * MS, 3 * MS, 20 * MS))  # bound 60%
    at_bound = config(time_s=10 * MS, baseline_s=10 * MS, bounds=Bounds(10 * MS, 3 * MS, 9.5 * MS))
    sb = step_bound([(1, drifted), (1, at_bound)], 100 * MS, 99 * MS)
    assert sb.terms[0].bound_s == pytest.approx(6 * MS) and sb.terms[0].hideable_s == pytest.approx(4 * MS)
    assert sb.terms[1].hideable_s == 0.0


def test_the_gap_between_estimate_and_measurement_is_explained():
    c = config(time_s=8 * MS, baseline_s=10 * MS, bounds=Bounds(5 * MS, 4 * MS, 10 * MS))
    over = step_bound([(10, c)], 100 * MS, 95 * MS)  # estimated 20 ms, measured 5 ms
    assert "exceeds the measured saving (5 ms) by 15 ms" in over.summary and "timed alone" in over.summary
    under = step_bound([(1, c)], 100 * MS, 80 * MS)  # estimated 2 ms, measured 20 ms
    assert "the step saved more (20 ms) than the ops alone predict (2 ms)" in under.summary


def test_a_step_with_an_op_without_bounds_has_no_bound_and_says_which():
    sb = step_bound([(1, config()), (3, config(bounds=None, problem=Problem.parse("ag:256x64x128:float32:8")))],
                    100 * MS, 90 * MS)
    assert sb.hideable_s is None and sb.overlap_perfect_s is None and sb.reached is None
    assert sb.unbounded == ["allgather_matmul:256x64x128:float32:8"]
    assert sb.summary.startswith("no step bound: 1 of its collective matmuls have no bounds")


def test_the_step_bound_refuses_bad_input():
    with pytest.raises(ValueError, match="give a count >= 1"):
        step_bound([(0, config())], 1.0, 1.0)
    with pytest.raises(ValueError, match="measured times must be above 0"):
        step_bound([(1, config())], 0.0, 1.0)


# --- the wire record --------------------------------------------------------------------------


def bounds_measurement(status="ok", compute=(3e-3,) * 3, communication=(2e-3,) * 3, baseline=(5e-3,) * 3):
    timing = {name: Timing.of(list(v)) for name, v in
              (("compute", compute), ("communication", communication), ("baseline", baseline)) if v}
    return BoundsMeasurement(problem=PROBLEM, hardware=HW, status=status, **timing)


def test_a_bounds_measurement_is_checked_like_a_measurement():
    b = bounds_measurement()
    assert b.ok and b.medians == {"compute_s": 3e-3, "communication_s": 2e-3, "bounds_baseline_s": 5e-3}
    with pytest.raises(ValidationError, match="needs 'compute', 'communication' and 'baseline'"):
        bounds_measurement(baseline=())
    with pytest.raises(ValidationError, match="sample counts"):
        bounds_measurement(compute=(3e-3,) * 2)
    forged = b.model_dump(mode="json")
    forged["compute"]["median_s"] = 1e-3
    with pytest.raises(ValidationError, match="disagrees with samples_s"):
        BoundsMeasurement.model_validate(forged)
    failed = bounds_measurement(status="oom", compute=(), communication=(), baseline=())
    assert not failed.ok and failed.medians is None


def test_a_confirmation_result_carries_its_bounds_and_one_without_stays_valid():
    m = Measurement(problem=PROBLEM, decomposition=Decomposition.baseline(), hardware=HW, status="compile_error")
    body = ResultIn.of("lease", ConfirmResult(measurements=[m], bounds=bounds_measurement()))
    again = ResultIn.model_validate_json(body.model_dump_json())
    assert again.result == ConfirmResult(measurements=[m], bounds=bounds_measurement())
    plain = ResultIn.model_validate({"lease_id": "lease", "measurements": [m.model_dump(mode="json")]})
    assert plain.result.bounds is None and plain.result.measurements == [m]
    with pytest.raises(ValidationError, match="'bounds' come with a confirmation"):
        ResultIn(lease_id="lease", measurement=m, bounds=bounds_measurement())
