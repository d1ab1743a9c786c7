"""Decomposition, Problem and Hardware: validation, JSON round trips, stable keys."""

import json

import pytest
from pydantic import ValidationError

from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.planning.problem import check_decomposition
from collective_matmul.planning.space import candidates

AG = Problem(collective="allgather_matmul", m=1024, k=256, n=512, dtype="bfloat16", axis_size=8)
RS = Problem(collective="matmul_reduce_scatter", m=1024, k=512, n=256, dtype="bfloat16", axis_size=8)
GW = Problem(collective="allgather_grad_weight", m=1024, k=256, n=512, dtype="bfloat16", axis_size=8)


def test_decomposition_is_immutable_and_hashable():
    d = Decomposition(direction="bidirectional", chunks=4, unroll=2, accumulate="float32")
    with pytest.raises(ValidationError):
        d.chunks = 2
    assert len({d, Decomposition.from_json(d.to_json())}) == 1


@pytest.mark.parametrize("problem", [AG, RS, GW])
def test_json_and_id_round_trip_every_candidate(problem):
    for config in candidates(problem):
        assert Decomposition.from_json(config.to_json()) == config
        assert Decomposition.from_id(config.id) == config
        assert Decomposition.model_validate(json.loads(config.to_json())) == config


def test_stable_ids_and_canonical_json():
    d = Decomposition(direction="bidirectional", chunks=4, unroll=2, accumulate="float32")
    assert d.id == "ring-bi-c4-u2-f32"
    assert Decomposition().id == "ring-uni-c1-full-auto"
    assert Decomposition.baseline().id == "baseline"
    assert d.to_json() == (
        '{"accumulate":"float32","chunks":4,"direction":"bidirectional","method":"ring","unroll":2}'
    )


def test_fuse_id_and_json_round_trip():
    fused = Decomposition(direction="bidirectional", chunks=4, unroll=2, accumulate="float32", fuse=True)
    assert fused.id == "ring-bi-c4-u2-f32-fuse"
    assert Decomposition.baseline(fuse=True).id == "baseline-fuse"
    assert Decomposition(chunks=2, accumulate="float32", fuse=True).id == "ring-uni-c2-full-f32-fuse"
    for config in (fused, Decomposition.baseline(fuse=True), Decomposition(fuse=True)):
        assert Decomposition.from_id(config.id) == config
        assert Decomposition.from_json(config.to_json()) == config
    parsed = Decomposition.from_id("ring-uni-c2-full-f32-fuse")
    assert parsed == Decomposition(chunks=2, accumulate="float32", fuse=True)
    # only a fused config carries the field: unfused JSON is as it was before `fuse` existed
    assert '"fuse":true' in fused.to_json()
    assert "fuse" not in Decomposition.baseline().to_json()
    assert Decomposition.from_json('{"method":"baseline"}') == Decomposition.baseline()
    assert Decomposition.baseline(fuse=True) != Decomposition.baseline()
    with pytest.raises(ValueError, match="not a decomposition id"):
        Decomposition.from_id("baseline-fuse-fuse")


def test_fuse_is_only_for_the_weight_gradient():
    for config in (Decomposition.baseline(fuse=True), Decomposition(chunks=2, accumulate="float32", fuse=True)):
        GW.check(config)
        for problem in (AG, RS):
            with pytest.raises(ValueError, match=f"fuse=True is not for {problem.collective}"):
                problem.check(config)
    # fusion couples two problems: it is never a candidate of one problem's study
    assert not any(config.fuse for config in candidates(GW))
    # the baseline takes fuse, but still no ring field
    with pytest.raises(ValidationError, match=r"takes no ring fields; remove \['chunks'\]"):
        Decomposition(method="baseline", fuse=True, chunks=2)


def test_problem_key_parse_and_json():
    assert AG.key == "allgather_matmul:1024x256x512:bfloat16:8"
    assert Problem.parse(AG.key) == AG
    assert Problem.parse("ag m=1024 k=256 n=512 dtype=bfloat16 axis_size=8") == AG
    assert Problem.parse("rs:1024x512x256:bfloat16:8") == RS
    assert AG.canonical_json() == (
        '{"axis_size":8,"collective":"allgather_matmul","dtype":"bfloat16","k":256,"m":1024,"n":512}'
    )
    assert Problem.model_validate_json(AG.canonical_json()) == AG
    assert GW.key == "allgather_grad_weight:1024x256x512:bfloat16:8"
    assert Problem.parse("gw:1024x256x512:bfloat16:8") == GW
    assert Problem.parse("gw m=1024 k=256 n=512 dtype=bfloat16 axis_size=8") == GW
    big = Problem.parse("gw:4096x1024x2048:float32:8")
    assert (big.collective, big.m, big.k, big.n, big.block_rows) == ("allgather_grad_weight", 4096, 1024, 2048, 512)
    assert Problem.parse(big.key) == big


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(m=1004), "m=1004 is not divisible by axis_size=8"),
        (dict(n=100), "n=100 is not divisible by axis_size=8"),
        (dict(m=-8), "greater than 0"),
        (dict(m=1 << 30), "less than or equal"),
        (dict(dtype="int8"), "float32"),
        (dict(collective="allreduce_matmul"), "allgather_matmul"),
    ],
)
def test_problem_rejects_bad_input_with_reason(fields, message):
    base = AG.model_dump() | fields
    with pytest.raises(ValidationError, match=message):
        Problem.model_validate(base)


def test_weight_gradient_problem_shards_m_and_n():
    # u [m, k] is gathered (m sharded), v [m, n] is sharded on n; k is not sharded
    assert Problem.model_validate(GW.model_dump() | {"k": 100}).k == 100
    for name in ("m", "n"):
        message = f"allgather_grad_weight: {name}=1004 is not divisible by axis_size=8"
        with pytest.raises(ValidationError, match=message):
            Problem.model_validate(GW.model_dump() | {name: 1004})


def test_problem_parse_errors_say_what_to_write():
    with pytest.raises(ValueError, match="start with the collective"):
        Problem.parse("m=1 k=2")
    with pytest.raises(ValueError, match="expected name=value"):
        Problem.parse("ag m=8 k")


@pytest.mark.parametrize(
    "config, problem, reason",
    [
        (dict(chunks=3), AG, "power of two"),
        (dict(chunks=256), AG, "less than or equal"),
        (dict(method="baseline", chunks=2), AG, "takes no ring fields"),
        (dict(unroll=3), AG, "unroll"),
        (dict(direction="sideways"), AG, "direction"),
    ],
)
def test_decomposition_field_errors(config, problem, reason):
    with pytest.raises(ValidationError, match=reason):
        Decomposition(**config)


@pytest.mark.parametrize(
    "config, problem, reason",
    [
        (Decomposition(chunks=64), Problem.parse("ag:256x8x8:float32:8"), "chunks=64 does not divide a block of 32"),
        (Decomposition(accumulate="float32"), AG, "accumulate='float32' is not for allgather_matmul"),
        (Decomposition(accumulate="concat"), RS, "accumulate='concat' is not for matmul_reduce_scatter"),
        (Decomposition(accumulate="update_slice"), GW, "accumulate='update_slice' is not for allgather_grad_weight"),
        (Decomposition(accumulate="float32"), GW.model_copy(update={"dtype": "float32"}), "same program"),
        (Decomposition(chunks=64), Problem.parse("gw:256x8x8:float32:8"), "chunks=64 does not divide a block of 32"),
        (Decomposition(fuse=True), AG, "fuse=True is not for allgather_matmul"),
        (Decomposition(accumulate="float32"), RS.model_copy(update={"dtype": "float32"}), "same program"),
        (Decomposition(direction="bidirectional"), Problem.parse("ag:64x8x8:float32:2"), "axis_size >= 3"),
        (Decomposition(direction="bidirectional", unroll=1), Problem.parse("ag:64x8x8:float32:4"), "loops 0 times"),
        (Decomposition(unroll=2), Problem.parse("ag:64x8x8:float32:2"), "unroll=2 needs a loop"),
        (Decomposition(), Problem.parse("ag:64x8x8:float32:1"), "axis_size >= 2"),
    ],
)
def test_invalid_combinations_name_the_reason(config, problem, reason):
    with pytest.raises(ValueError, match=reason):
        problem.check(config)
    assert config not in candidates(problem)


def test_check_rejects_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        check_decomposition(Decomposition(), collective="x", block_rows=8, axis_size=8, dtype="float32")


def test_space_sizes():
    # 2 directions x 4 chunks x 3 unrolls x 2 accumulates + baseline
    assert len(candidates(AG)) == 49
    assert len(candidates(RS)) == 49
    assert len(candidates(GW)) == 49
    assert candidates(GW)[0] == Decomposition.baseline()
    assert {c.accumulate for c in candidates(GW)} == {None, "input_dtype", "float32"}
    assert len(candidates(GW.model_copy(update={"dtype": "float32"}))) == 25
    # float32 reduce-scatter: the float32 accumulator is the input dtype
    assert len(candidates(RS.model_copy(update={"dtype": "float32"}))) == 25
    # 4 devices: the bidirectional ring has no loop middle, so only unroll='full' remains
    small = Problem.parse("ag:64x8x8:float32:4")
    assert {c.unroll for c in candidates(small) if c.direction == "bidirectional"} == {"full"}
    assert len(candidates(small)) == 1 + 24 + 8


def test_hardware_detect_and_key():
    hw = Hardware.detect()
    assert (hw.platform, hw.device_count, hw.process_count) == ("cpu", 8, 1)
    assert hw.jax_version and hw.jaxlib_version
    assert hw.key == f"cpu:{hw.device_kind}:8:1"
    assert hw.identity().jax_version == ""
    assert Hardware.model_validate_json(hw.canonical_json()) == hw.identity()
    assert json.loads(hw.canonical_json())["device_count"] == 8
    assert "slice_devices" not in json.loads(hw.canonical_json())  # a whole machine's, as before


def test_a_ring_of_part_of_a_slice_is_keyed_by_its_size_and_the_slice():
    machine = Hardware(platform="cpu", device_kind="cpu", device_count=8, process_count=2)
    assert machine.key == "cpu:cpu:8:2" and machine.ring(8) is machine
    ring = machine.ring(4)
    assert (ring.device_count, ring.process_count, ring.slice_devices, ring.key) == (4, 1, 8, "cpu:cpu:4:1/8")
    assert ring.ring(2).key == "cpu:cpu:2:1/8"  # a ring of a ring stays part of the slice
    assert [r.key for r in machine.rings()] == ["cpu:cpu:8:2", "cpu:cpu:4:1/8", "cpu:cpu:2:1/8"]
    assert Hardware.model_validate_json(ring.model_dump_json()) == ring
    assert Hardware.model_validate_json(ring.canonical_json()) == ring
    # a slice of the ring's own size is the whole machine: one key for it
    assert Hardware(platform="cpu", device_kind="cpu", device_count=4, slice_devices=4).key == "cpu:cpu:4:1"
    slice_v5p = Hardware(platform="tpu", device_kind="TPU v5", device_count=32, process_count=8)
    assert [r.key for r in slice_v5p.rings()][1:4] == ["tpu:TPU v5:16:4/32", "tpu:TPU v5:8:2/32",
                                                       "tpu:TPU v5:4:1/32"]
    assert [r.key for r in Hardware(platform="cpu", device_kind="cpu", device_count=1).rings()] == ["cpu:cpu:1:1"]
    with pytest.raises(ValueError, match="a ring of 3 devices does not divide the 8 devices of cpu:cpu:8:2"):
        machine.ring(3)
    with pytest.raises(ValueError, match="slice_devices must be a multiple of device_count"):
        Hardware(platform="cpu", device_kind="cpu", device_count=3, slice_devices=8)


def test_detect_names_the_slice_a_ring_is_part_of():
    import jax

    ring = Hardware.detect(jax.devices()[:4], slice_devices=8)
    assert ring.key == f"cpu:{ring.device_kind}:4:1/8" and ring.software is not None
    assert Hardware.detect(jax.devices(), slice_devices=8).slice_devices is None


@pytest.mark.parametrize("spec, dual, sharded", [
    ("wk:1024x256x512:bfloat16:8", "allgather_grad_weight:256x512x1024:bfloat16:8", "k"),
    ("wn:1024x512x256:bfloat16:8", "allgather_matmul:256x512x1024:bfloat16:8", "n"),
    ("rsw:1024x256x512:bfloat16:8", "matmul_reduce_scatter:256x1024x512:bfloat16:8", "k"),
])
def test_the_weight_collectives_are_keyed_as_their_own_and_run_as_their_dual(spec, dual, sharded):
    """FSDP's problems: their own keys (never an activation's), the space and memory of the activation ring they
    run as, and a ring of m's rows and of the sharded weight dimension."""
    problem = Problem.parse(spec)
    assert problem.key.startswith(problem.collective) and problem.collective.startswith(("weight_", "reduce_"))
    assert problem.dual == Problem.parse(dual) and problem.dual.dual == problem.dual
    assert Problem.model_validate_json(problem.model_dump_json()) == problem
    assert candidates(problem) == candidates(problem.dual) and problem.device_bytes == problem.dual.device_bytes
    assert problem.block_rows == getattr(problem, sharded) // 8
    for name in ("m", sharded):
        fields = problem.model_dump() | {name: 1004}
        with pytest.raises(ValidationError, match=f"{problem.collective}: {name}=1004 is not divisible by axis_size"):
            Problem(**fields)
    with pytest.raises(ValueError, match=rf"does not divide a block of 32 rows \({sharded} / axis_size\)"):
        problem.check(Decomposition(chunks=64))


def test_fuse_is_the_weight_gradients_in_fsdps_collectives_too():
    """fuse (the backward keeps the gathered weight) is a weight-gradient config's, never a candidate."""
    gradient = Problem.parse("rsw:1024x256x512:float32:8")
    gradient.check(Decomposition.baseline(fuse=True))
    assert not any(c.fuse for c in candidates(gradient))
    for spec in ("wk:1024x256x512:float32:8", "wn:1024x256x512:float32:8"):
        with pytest.raises(ValueError, match=f"fuse=True is not for {Problem.parse(spec).collective}"):
            Problem.parse(spec).check(Decomposition.baseline(fuse=True))
