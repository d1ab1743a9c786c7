"""The step search's policy (`cmtune.tuner.stepsearch`), on synthetic steps: times a deterministic function of
the configs, paired rounds without noise unless a test adds it.  No devices are touched."""

from __future__ import annotations

import itertools

import pytest

from cmtune.tuner.paired import faster, ratio_quartiles
from cmtune.tuner.stepsearch import REFERENCE, SEEDS, SearchSpace, StepSearch, replay, variant_name
from cmtune.tuner.variants import FIXED_RING
from collective_matmul import Decomposition, Hardware, OpConfigs
from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT
from collective_matmul.planning.models import SLOTS, TransformerBlock
from collective_matmul.wire import (
    MAX_VARIANT_NAME,
    MeasurementProtocol,
    StepMeasurement,
    StepVariant,
    Timing,
    quartiles,
)

D = Decomposition.from_id
BLOCK = TransformerBlock(name="small", d_model=64, d_ff=128, heads=8, head_dim=8, gated_mlp=True, seq_len=64,
                         global_batch=2, dtype="float32")
AG, AG2 = D("ring-bi-c2-full-dus"), D("ring-uni-c2-full-dus")  # all-gather side: the winner, a runner-up
RS, RS2 = D("ring-bi-c1-full-in"), D("ring-uni-c2-full-in")  # reduce-scatter side
WG, WG2 = D("ring-uni-c2-full-in"), D("ring-bi-c1-full-in")  # weight gradient
BASE = Decomposition.baseline()
WINNERS = {
    "qkv": OpConfigs(forward=AG, grad_input=RS, grad_weight=WG),
    "attn_out": OpConfigs(forward=RS, grad_input=AG, grad_weight=DEFAULT_GRAD_WEIGHT),
    "mlp_up": OpConfigs(forward=AG, grad_input=RS, grad_weight=WG),
    "mlp_down": OpConfigs(forward=RS, grad_input=AG, grad_weight=DEFAULT_GRAD_WEIGHT),
}
SIDES = {"qkv": ("ag", "rs"), "attn_out": ("rs", "ag"), "mlp_up": ("ag", "rs"), "mlp_down": ("rs", "ag")}
OPTIONS = {"ag": (AG, AG2, FIXED_RING, BASE), "rs": (RS, RS2, FIXED_RING, BASE),
           "gw": (WG, WG2, FIXED_RING, DEFAULT_GRAD_WEIGHT)}


def candidates(role: str) -> dict[str, tuple[Decomposition, ...]]:
    forward, grad_input = SIDES[role]
    winner = WINNERS[role]
    return {slot: tuple(dict.fromkeys((getattr(winner, slot), *OPTIONS[side])))
            for slot, side in zip(SLOTS, (forward, grad_input, "gw"), strict=True)}


SPACE = SearchSpace(winners=WINNERS, candidates={role: candidates(role) for role in WINNERS},
                    costmodel={role: OpConfigs(forward=FIXED_RING) for role in WINNERS})


# A landscape in which each slot's cost in the step is its own (plus a weight-gradient fusion bonus): the op-level
# winners are not the step's best everywhere, and one fixed ring beats them, as measured (issue 20).
COST = {
    ("qkv", "forward"): {AG: 0.030, AG2: 0.020, FIXED_RING: 0.026, BASE: 0.050},
    ("qkv", "grad_input"): {RS: 0.030, RS2: 0.034, FIXED_RING: 0.028, BASE: 0.045},
    ("attn_out", "forward"): {RS: 0.030, RS2: 0.031, FIXED_RING: 0.022, BASE: 0.040},
    ("attn_out", "grad_input"): {AG: 0.025, AG2: 0.035, FIXED_RING: 0.030, BASE: 0.040},
    ("mlp_up", "forward"): {AG: 0.040, AG2: 0.045, FIXED_RING: 0.042, BASE: 0.060},
    ("mlp_up", "grad_input"): {RS: 0.040, RS2: 0.030, FIXED_RING: 0.041, BASE: 0.060},
    ("mlp_down", "forward"): {RS: 0.040, RS2: 0.044, FIXED_RING: 0.036, BASE: 0.060},
    ("mlp_down", "grad_input"): {AG: 0.040, AG2: 0.041, FIXED_RING: 0.043, BASE: 0.030},
}
WEIGHT = {WG: 0.030, WG2: 0.034, FIXED_RING: 0.026, DEFAULT_GRAD_WEIGHT: 0.035, BASE: 0.045}


def seconds(setting) -> float:
    """The step time of a setting (None: the step as written, 1 s)."""
    if setting is None:
        return 1.0
    total = 0.5
    for role, configs in (WINNERS | dict(setting)).items():
        for slot in ("forward", "grad_input"):
            total += COST[role, slot][getattr(configs, slot)]
        weight = configs.grad_weight
        total += WEIGHT[weight.model_copy(update={"fuse": False}) if weight.method == "ring" else weight]
        total -= 0.004 if weight.method == "ring" and weight.fuse else 0.0
    return round(total, 6)


def measure(variants, time=seconds, rounds: int = 4) -> StepMeasurement:
    """The round's measurement: each variant's samples from ``time`` (a list per round, or one value)."""
    reference = [time(None)] * rounds if not isinstance(time(None), list) else time(None)
    timed = []
    for name, setting in variants.items():
        samples = time(setting)
        samples = samples if isinstance(samples, list) else [samples] * rounds
        q1, median, q3 = quartiles([t / r for t, r in zip(samples, reference, strict=True)])
        timed.append(StepVariant(name=name, status="ok", configs=dict(setting or {}), timing=Timing.of(samples),
                                 ratio=median, ratio_iqr=q3 - q1))
    return StepMeasurement(block=BLOCK, mesh={"model": 8}, tensor_axis="model",
                           hardware=Hardware(platform="cpu", device_kind="cpu", device_count=8),
                           protocol=MeasurementProtocol(repeats=rounds), variants=timed)


def run(search: StepSearch, time=seconds):
    """Run ``search`` to its grading: (decision, the rounds as (variants, measurement))."""
    rounds = []
    while (plan := search.plan()).kind == "search":
        result = measure(plan.variants, time)
        rounds.append((plan.variants, result))
        search.record(plan.variants, result, wall_s=2.0)
    assert plan.kind == "grade"
    return search.decide(measure(plan.variants, time)), rounds


def best_combination() -> dict[str, OpConfigs]:
    """The fastest setting the candidates make (the landscape is additive: each slot on its own)."""
    best = {}
    for role in WINNERS:
        options = candidates(role)
        rings = [w.model_copy(update={"fuse": True}) for w in options["grad_weight"] if w.method == "ring"]
        combos = itertools.product(options["forward"], options["grad_input"], (*options["grad_weight"], *rings))
        best[role] = min((OpConfigs(forward=f, grad_input=g, grad_weight=w) for f, g, w in combos),
                         key=lambda c: seconds({role: c}))
    return best


def test_the_search_finds_a_planted_combination_no_fixed_setting_has():
    planted = best_combination()
    search = StepSearch(SPACE, rounds=40, per_round=4, model="small")
    decision, rounds = run(search)
    fixed = rounds[0][0]
    assert list(fixed) == [REFERENCE, *SEEDS]  # every seed differs here
    assert planted not in [dict(s) for s in fixed.values() if s is not None]
    assert decision.ok and search.names[decision.variant] == planted
    # the fixed menu alone (one round, the ablation with it) picks a fixed setting: always-ring is its best
    menu = StepSearch(SPACE, rounds=1, model="small")
    alone, menu_rounds = run(menu)
    assert len(menu_rounds) == 1 and alone.variant == "always-ring" and menu.names[alone.variant] != planted
    assert any(name.startswith("tuned-minus-") for name in menu_rounds[0][0])
    assert seconds(planted) < min(seconds(s) for s in menu_rounds[0][0].values() if s is not None)
    # the decision: graded in the fresh rounds, against the seed too, its overrides with the round that found them
    record = decision.record
    assert record.fresh_rounds and record.seed == "always-ring" and record.vs_seed.median > 1
    assert record.rounds == len(rounds) and record.search_s == pytest.approx(2.0 * (len(rounds) - 1))
    assert record.variants_tried == len({tuple(sorted(s.items())) for v, _ in rounds for s in v.values() if s})
    assert set(decision.overrides) == {r for r in WINNERS if planted[r] != WINNERS[r]}
    for role, reason in decision.reasons.items():
        assert "of the step search) ran the step" in reason and f"so {role} " in reason and "for small" in reason
    assert "the search:" in decision.summary and "against always-ring, the best fixed setting" in decision.summary
    # and against every fixed setting, in the same fresh rounds: the planted combination is ahead of each
    assert set(record.vs_fixed) == set(SEEDS) and all(s.low > 1 for s in record.vs_fixed.values())
    assert "ahead of every other fixed setting (baseline, tuned, costmodel, tuned-ring-fill, always-ring)" in (
        decision.summary)
    # a choice that is one of them is graded against the others, and says which it does not lead
    assert set(alone.record.vs_fixed) == set(SEEDS) - {"always-ring"}


def test_the_search_stops_at_its_budget_and_when_a_pass_changes_nothing():
    for budget in (2, 3, 4):
        search = StepSearch(SPACE, rounds=budget)
        _, rounds = run(search)
        assert len(rounds) == budget
        assert search.plan().reason == f"the search budget of {budget} rounds"
    # a step where nothing beats the op-level winners: one full pass (a round per role), then the grading
    flat = StepSearch(SPACE, rounds=50, per_round=16)
    decision, rounds = run(flat, lambda s: 1.0 if s is None else 0.8)
    assert decision.variant == "tuned" and decision.overrides == {} and len(rounds) == 1 + len(WINNERS)
    assert flat.plan().reason.startswith("a full pass over the roles changed nothing")
    assert [plan_role(v) for v, _ in rounds[1:]] == list(WINNERS)


def plan_role(variants) -> str:
    roles = {role for name, s in variants.items() if name.startswith("r") and s for role, c in s.items()
             if c != WINNERS[role]}
    (role,) = roles
    return role


def test_a_change_is_accepted_only_beyond_the_spread():
    """Faster in the median but not in three rounds of four: never the incumbent."""
    def time(setting):
        if setting is None:
            return [1.0] * 4
        base = seconds(setting)
        if setting.get("qkv", WINNERS["qkv"]).forward == AG2:  # faster in the median, slower in two rounds
            return [base * 0.5, base * 0.5, base * 1.3, base * 1.3]
        return [base] * 4

    search = StepSearch(SPACE, rounds=40, per_round=4)
    decision, rounds = run(search, time)
    tempting = 0
    for variants, result in rounds[1:]:
        incumbent = list(variants)[1]  # a search round: the reference, the incumbent, then its proposals
        for name, setting in variants.items():
            if name != incumbent and setting and setting["qkv"].forward == AG2:
                q1, median, q3 = ratio_quartiles(result, name, incumbent)
                assert median < 1 <= q3  # faster in the median, not in three rounds of four
                tempting += 1
    assert tempting and all(search.names[a.variant]["qkv"].forward != AG2 for a in search.accepted)
    for step in search.accepted:  # each acceptance held the rule against what it replaced, in its own round
        _, result = rounds[step.round - 1]
        assert faster(result, step.variant, step.replaced) == step.paired and step.paired[2] < 1
    assert search.names[decision.variant]["qkv"].forward != AG2


def test_the_search_resumes_from_stored_rounds_to_the_same_next_proposal():
    search = StepSearch(SPACE, rounds=10, per_round=3)
    stored = []
    while (plan := search.plan()).kind == "search":
        again = replay(SPACE, stored, rounds=10, per_round=3)
        assert again.plan() == plan  # the same round: its names, configs and role
        result = measure(plan.variants)
        stored.append((plan.variants, result, 1.5))
        search.record(plan.variants, result, wall_s=1.5)
    again = replay(SPACE, stored, rounds=10, per_round=3)
    assert again.plan() == plan and plan.kind == "grade"
    graded = measure(plan.variants)
    assert again.decide(graded) == search.decide(graded)
    # a round without a result (a lost trial) changes nothing and the search goes on
    lost = replay(SPACE, [*stored[:2], (stored[2][0], None, None)], rounds=10, per_round=3)
    assert lost.incumbent == replay(SPACE, stored[:2], rounds=10, per_round=3).incumbent
    assert lost.search_s is None and lost.plan().kind in ("search", "grade")


def test_the_first_round_decides_as_the_menu_did():
    """tuned stays unless a seed is faster beyond the spread; without tuned's result the search fails."""
    search = StepSearch(SPACE, rounds=3)
    plan = search.plan()
    search.record(plan.variants, measure(plan.variants, lambda s: 1.0 if s is None else 0.9))
    assert search.incumbent == search.seed == "tuned"
    broken = StepSearch(SPACE, rounds=3)
    result = measure(broken.plan().variants)
    failed = result.model_copy(update={"variants": [v if v.name != "tuned" else StepVariant(
        name="tuned", status="compile_error", message="boom") for v in result.variants]})
    broken.record(broken.plan().variants, failed)
    assert broken.plan().kind == "failed" and "tuned compile_error: boom" in broken.plan().reason
    assert not broken.decide(None).ok


def test_every_variant_name_is_unique_and_bounded():
    long = "a" * 200
    space = SearchSpace(winners={long: WINNERS["qkv"], long[:-1] + "b": WINNERS["mlp_up"]},
                        candidates={long: candidates("qkv"), long[:-1] + "b": candidates("mlp_up")})
    search = StepSearch(space, rounds=30, per_round=16)
    names = []
    while (plan := search.plan()).kind == "search":
        names += [n for n in plan.variants if n not in names]
        search.record(plan.variants, measure(plan.variants, lambda s: 1.0 if s is None else 0.8))
    assert len(names) == len(set(names)) and max(map(len, names)) <= MAX_VARIANT_NAME
    assert len(variant_name(12, long, "baseline")) < MAX_VARIANT_NAME  # a role of the longest kind fits whole
    # past what fits, a role keeps its start and a digest of the whole: still bounded, still unique
    cut = variant_name(10**9, long, "unfuse"), variant_name(10**9, long[:-1] + "b", "unfuse")
    assert cut[0] != cut[1] and {len(n) for n in cut} == {MAX_VARIANT_NAME} and cut[0].endswith("-unfuse")


def test_a_choice_slower_than_its_seed_in_the_fresh_rounds_gives_way_to_the_seed():
    """The rounds that accepted a change favour it (many variants, a few rounds each): where the grading's fresh
    rounds time the search's choice slower than the seeds' choice, the seed runs."""
    search = StepSearch(SPACE, rounds=40, per_round=4, model="small")
    while (plan := search.plan()).kind == "search":
        search.record(plan.variants, measure(plan.variants), wall_s=2.0)
    chosen, seed = search.incumbent, search.seed
    assert chosen != seed and set(plan.variants) >= {chosen, seed}

    def fresh(setting):  # the grading: the choice now 3% slower than the seed
        return seconds(search.names[seed]) * 1.03 if setting == search.names[chosen] else seconds(setting)

    decision = search.decide(measure(plan.variants, fresh))
    assert decision.ok and decision.variant == seed and decision.record.variant == seed
    assert f"the search's choice {chosen} was slower than {seed} in the fresh rounds" in decision.summary
    assert set(decision.overrides) == {r for r, c in search.names[seed].items() if c != WINNERS[r]}
    assert all(f"faster than the search's choice {chosen} in the fresh rounds of its grading ({chosen} ran 0.97x "
               "(IQR 0.97-0.97) of its speed)" in reason for reason in decision.reasons.values())
    # and where the fresh rounds agree with the search, its choice stands
    assert search.decide(measure(plan.variants)).variant == chosen


def test_a_choice_any_fixed_setting_outruns_in_the_grading_gives_way_to_the_fastest_of_them():
    """Not only the seed: where the grading's fresh rounds time other fixed settings faster than the search's choice
    in the median (as always-ring was on the large processes:2 row, 2026-12-01), the fastest of them runs; a fixed
    setting slower in the median does not displace it."""
    search = StepSearch(SPACE, rounds=40, per_round=4, model="small")
    while (plan := search.plan()).kind == "search":
        search.record(plan.variants, measure(plan.variants), wall_s=2.0)
    chosen, seed = search.incumbent, search.seed
    others = [name for name in SEEDS if name not in (seed, chosen) and name in plan.variants]
    assert len(others) >= 2
    first, second = others[:2]
    base = seconds(search.names[chosen])

    def fresh(setting, faster: dict):  # the grading: some fixed settings now ahead of the choice
        for name, by in faster.items():
            if setting == search.names[name]:
                return base / by
        return base * 1.10 if setting is not None and setting != search.names[chosen] else seconds(setting)

    decision = search.decide(measure(plan.variants, lambda s: fresh(s, {first: 1.01, second: 1.03})))
    assert decision.variant == second and decision.record.variant == second
    assert f"the search's choice {chosen} was slower than {second} in the fresh rounds" in decision.summary
    assert decision.overrides == {r: c for r, c in (search.names[second] or {}).items() if c != WINNERS[r]}
    # a tie is not a win: the choice stands where every fixed setting is slower in the median or level with it
    level = search.decide(measure(plan.variants, lambda s: fresh(s, {first: 1.0})))
    assert level.variant == chosen


def test_an_acceptance_the_next_round_times_slower_than_its_rival_is_taken_back():
    """A change that passed the rule in its own round by chance: the next round times it beside what it replaced,
    and where it is slower there in the median, what it replaced is the incumbent again."""
    search = StepSearch(SPACE, rounds=4, per_round=2, model="small")
    plan = search.plan()
    search.record(plan.variants, measure(plan.variants))
    seed = search.incumbent
    plan = search.plan()
    lucky = plan.variants[list(plan.variants)[-1]]
    incumbent_s = seconds(search.names[seed])

    def time(factor):  # the lucky change at ``factor`` of the incumbent, every other change 10% slower
        return lambda s: seconds(s) if s is None or s == search.names[seed] else incumbent_s * (
            factor if s == lucky else 1.1)

    search.record(plan.variants, measure(plan.variants, time(0.95)))
    proposal = search.incumbent
    assert search.names[proposal] == lucky and search.accepted[-1].variant == proposal
    plan = search.plan()  # the re-check: the rival (what it replaced) timed again beside it
    assert list(plan.variants)[:3] == [REFERENCE, proposal, seed]
    search.record(plan.variants, measure(plan.variants, time(1.03)))
    assert search.incumbent == seed and proposal not in {a.variant for a in search.accepted}
    check = search.rechecks[-1]
    assert (check.round, check.variant, check.rival, check.kept) == (3, proposal, seed, False)
    assert check.paired[1] == pytest.approx(1.03)
    assert f"ran 0.97x (IQR 0.97-0.97) of {seed}'s speed in this round's fresh rounds, so {seed} is back" in (
        search.summary())  # slower: a speed below 1
    # where the fresh rounds agree, the acceptance stays and the search goes on from it
    again = replay(SPACE, [(v, r, None) for v, r in search.rounds[:2]], rounds=4, per_round=2)
    plan = again.plan()
    again.record(plan.variants, measure(plan.variants, time(0.95)))
    assert again.incumbent == proposal and again.rechecks[-1].kept and "again, so it stays" in again.summary()


def test_the_seeds_choice_is_rechecked_against_the_runner_up_seed():
    """Two seeds faster than tuned: the next round times the runner-up again, and the seed follows the fresh rounds."""
    search = StepSearch(SPACE, rounds=3, per_round=2)
    plan = search.plan()
    search.record(plan.variants, measure(plan.variants))
    assert search.seed == search.incumbent == "always-ring"
    assert seconds(plan.variants["tuned-ring-fill"]) < seconds(plan.variants["tuned"])  # the runner-up seed
    plan = search.plan()
    assert list(plan.variants)[:3] == [REFERENCE, "always-ring", "tuned-ring-fill"]
    fill = plan.variants["tuned-ring-fill"]
    search.record(plan.variants, measure(plan.variants, lambda s: 0.5 if s == fill else seconds(s)))
    assert search.seed == "tuned-ring-fill"  # fill was fastest; no proposal beat it
    assert [(a.round, a.variant, a.replaced) for a in search.accepted] == [(1, "tuned-ring-fill", "tuned")]
    assert search.rechecks[0].kept is False and search.rechecks[0].rival == "tuned-ring-fill"
    assert search.incumbent == "tuned-ring-fill"


def test_a_round_proposes_the_role_as_the_other_fixed_settings_run_it_first():
    search = StepSearch(SPACE, rounds=3, per_round=3)
    plan = search.plan()
    search.record(plan.variants, measure(plan.variants, lambda s: 1.0 if s is None else 0.8))  # tuned stays
    plan = search.plan()  # qkv's winners are rings everywhere: tuned-ring-fill runs them as they are
    assert [n.rsplit("-", 1)[1] for n in plan.variants if n.startswith("r2-")] == ["ring", "fuse", "fw2"]
    assert plan.variants["r2-qkv-ring"]["qkv"] == OpConfigs(forward=FIXED_RING, grad_input=FIXED_RING,
                                                             grad_weight=FIXED_RING)
    search.record(plan.variants, measure(plan.variants, lambda s: 1.0 if s is None else 0.8))
    plan = search.plan()  # attn_out's weight gradient is at the baseline: tuned-ring-fill puts it on the fixed ring
    assert [n.rsplit("-", 1)[1] for n in plan.variants if n.startswith("r3-")] == ["fill", "ring", "fw2"]
    assert plan.variants["r3-attn_out-fill"]["attn_out"] == WINNERS["attn_out"].model_copy(
        update={"grad_weight": FIXED_RING})
