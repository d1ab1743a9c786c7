"""The predictor of compiled programs on hand-written scheduled modules: the replay's arithmetic, exactly.

A profile of round rates (1 TFLOP/s float32 at full efficiency, 100 GB/s of memory, 1 GB/s links, 1 µs of
latency, no issue cost) makes every figure a sum a reader can check by hand.
"""

from __future__ import annotations

import pytest

from collective_matmul.planning.costmodel import PROFILES, HardwareProfile
from collective_matmul.programs.costs import nbytes
from collective_matmul.programs.hlo import Shape
from collective_matmul.programs.predict import Prediction, predict

ROUND = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, link_bytes_per_s=1e9, latency_s=1e-6, op_s=0.0,
                        memory_bytes_per_s=1e11, matmul_efficiency={"float32": 1.0})
DOT = 2 * 100 * 50 * 200 / 1e12  # f32[100,200] x f32[200,50]: compute-bound (140 kB over 100 GB/s is 1.4 µs)
PERMUTE = 1e-6 + 100 * 200 * 4 / 1e9  # one f32[100,200] block over one link, with its latency
ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""  # a reduction's computation


def module(body: str, partitions: int = 4, extra: str = "") -> str:
    return f"HloModule m, is_scheduled=true, num_partitions={partitions}\n{extra}\nENTRY e {{\n{body}\n}}\n"


def test_a_product_alone_is_its_roofline():
    text = module("""
  a = f32[100,200]{1,0} parameter(0)
  b = f32[200,50]{1,0} parameter(1)
  ROOT d = f32[100,50]{1,0} dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}""")
    got = predict(text, ROUND)
    assert got == Prediction(seconds=DOT, exposed_comm_s=0.0, comm_s=0.0, compute_s=DOT,
                             cost_model="cmtune-roofline/round")
    assert got.overlapped_share is None
    slow_memory = ROUND.model_copy(update={"memory_bytes_per_s": 1e9})  # now 140 kB take 140 µs: memory-bound
    assert predict(text, slow_memory).seconds == pytest.approx((100 * 200 + 200 * 50 + 100 * 50) * 4 / 1e9, rel=1e-12)


def test_an_all_gather_then_a_product_is_their_sum_and_nothing_hidden():
    text = module("""
  x = f32[100,200]{1,0} parameter(0)
  w = f32[200,50]{1,0} parameter(1)
  g = f32[400,200]{1,0} all-gather(x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT d = f32[400,50]{1,0} dot(g, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}""")
    gather = 3 * 1e-6 + 400 * 200 * 4 * 3 / 4 / 1e9  # a ring of 4: 3 hops, 3/4 of the whole over one link
    got = predict(text, ROUND)
    assert got.comm_s == pytest.approx(gather, rel=1e-12) and got.exposed_comm_s == got.comm_s
    assert got.compute_s == pytest.approx(4 * DOT, rel=1e-12)
    assert got.seconds == pytest.approx(gather + 4 * DOT, rel=1e-12) and got.overlapped_share == 0.0
    torus = ROUND.model_copy(update={"wraparound_from": 4})  # a torus axis of 4: two links into each device
    assert predict(text, torus).comm_s == pytest.approx(3 * 1e-6 + 400 * 200 * 4 * 3 / 4 / 2e9, rel=1e-12)


PERMUTED = """
  x = f32[100,200]{1,0} parameter(0)
  w = f32[200,50]{1,0} parameter(1)
  s = ((f32[100,200]{1,0}), f32[100,200]{1,0}) collective-permute-start(x), source_target_pairs={{0,1},{1,0}}
  {first}
  r = f32[100,200]{1,0} collective-permute-done(s)
  {second}
  ROOT t = (f32[100,50]{1,0}, f32[100,200]{1,0}) tuple(d, r)"""
PRODUCT = "d = f32[100,50]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def permuted(first: str, second: str) -> str:
    return module(PERMUTED.replace("{first}", first).replace("{second}", second), 2)


def test_a_permute_hides_the_product_it_brackets_and_not_one_after_it():
    bracketing = predict(permuted(PRODUCT, ""), ROUND)
    after = predict(permuted("", PRODUCT), ROUND)
    assert bracketing.comm_s == after.comm_s == pytest.approx(PERMUTE, rel=1e-12)
    assert bracketing.seconds == pytest.approx(PERMUTE, rel=1e-12)  # the done waits for the transfer's end
    assert bracketing.exposed_comm_s == pytest.approx(PERMUTE - DOT, rel=1e-12)
    assert bracketing.overlapped_share == pytest.approx(DOT / PERMUTE, rel=1e-12)
    assert after.seconds == pytest.approx(PERMUTE + DOT, rel=1e-12) and after.exposed_comm_s == after.comm_s
    assert predict(permuted(PRODUCT, ""), ROUND, serial=True).seconds == \
        pytest.approx(PERMUTE + DOT, rel=1e-12)  # the same schedule with nothing overlapped


def test_a_start_xla_runs_on_the_compute_stream_hides_nothing():
    text = permuted(PRODUCT, "").replace(
        "source_target_pairs={{0,1},{1,0}}",
        'source_target_pairs={{0,1},{1,0}}, backend_config={"collective_backend_config":{"is_sync":true}}')
    assert predict(text, ROUND).seconds == pytest.approx(PERMUTE + DOT, rel=1e-12)


def test_a_while_loop_is_its_trip_count_times_its_body_and_condition():
    extra = """
body {
  p = (s32[], f32[100,100]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[100,100]{1,0} get-tuple-element(p), index=1
  one = s32[] constant(1)
  n = s32[] add(i, one)
  y = f32[100,100]{1,0} dot(x, x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = (s32[], f32[100,100]{1,0}) tuple(n, y)
}

cond {
  p = (s32[], f32[100,100]{1,0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  five = s32[] constant(5)
  ROOT lt = pred[] compare(i, five), direction=LT
}
"""
    text = module("""
  x = f32[100,100]{1,0} parameter(0)
  zero = s32[] constant(0)
  init = (s32[], f32[100,100]{1,0}) tuple(zero, x)
  ROOT w = (s32[], f32[100,100]{1,0}) while(init), condition=cond, body=body""", 1, extra)
    body = 2 * 100**3 / 1e12 + 12 / 1e11  # the product, and the counter's add (three s32 moved)
    condition = 9 / 1e11  # two s32 read, one pred written
    got = predict(text, ROUND)
    assert got.seconds == pytest.approx(5 * body + 6 * condition, rel=1e-12)
    assert got.comm_s == 0.0 and not got.unpriced


def test_a_kernel_the_schedule_cannot_see_into_is_said_to_be_unpriced():
    text = module("""
  x = f32[100,200]{1,0} parameter(0)
  ROOT k = f32[100,200]{1,0} custom-call(x), custom_call_target="my_pallas_kernel"
""")
    got = predict(text, ROUND)
    assert got.seconds == 0.0 and got.unpriced == ("custom-call k (my_pallas_kernel)",)
    assert "unpriced: custom-call k" in got.summary()


def test_an_async_reduce_scatter_gpu_writes_as_async_start_is_a_ring_that_overlaps():
    extra = """
wrapped {
  a = f32[400,50]{1,0} parameter(0)
  ROOT rs = f32[100,50]{1,0} reduce-scatter(a), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=add
}
"""
    text = module("""
  y = f32[400,50]{1,0} parameter(0)
  x = f32[100,200]{1,0} parameter(1)
  w = f32[200,50]{1,0} parameter(2)
  s = ((f32[400,50]{1,0}), f32[100,50]{1,0}) async-start(y), calls=wrapped
  d = f32[100,50]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  r = f32[100,50]{1,0} async-done(s)
  ROOT t = (f32[100,50]{1,0}, f32[100,50]{1,0}) tuple(d, r)""", 4, extra)
    ring = 3 * 1e-6 + 400 * 50 * 4 * 3 / 4 / 1e9
    got = predict(text, ROUND)
    assert got.comm_s == pytest.approx(ring, rel=1e-12) and got.seconds == pytest.approx(ring, rel=1e-12)
    assert got.exposed_comm_s == pytest.approx(ring - DOT, rel=1e-12)


def test_bytes_of_every_dtype_and_the_published_profiles_carry_their_sources():
    assert nbytes(Shape.parse("bf16[2,3]{1,0}")) == 12 and nbytes(Shape.parse("pred[8]")) == 8
    assert nbytes(Shape.parse("s4[4]")) == 2 and nbytes(Shape.parse("(f32[2], f8e4m3fn[4])")) == 12
    for name in ("tpu-v4", "tpu-v5e", "tpu-v5p", "h100-nvlink", "h200-nvlink"):
        profile = PROFILES[name]
        assert profile.matmul_efficiency and profile.efficiency_source and profile.links_source and profile.source


def test_a_reduce_scatter_tpu_fuses_as_a_sliced_all_reduce_is_priced_as_the_reduce_scatter():
    extra = ADD + """
all-reduce-scatter {
  p = f32[400,50]{1,0} parameter(0)
  ar = f32[400,50]{1,0} all-reduce(p), replica_groups={{0,1,2,3}}, to_apply=add
  i = u32[] partition-id()
  zero = u32[] constant(0)
  ROOT ds = f32[100,50]{1,0} dynamic-slice(ar, i, zero), dynamic_slice_sizes={100,50}
}
"""
    text = module("""
  y = f32[400,50]{1,0} parameter(0)
  ROOT f = f32[100,50]{1,0} fusion(y), kind=kCustom, calls=all-reduce-scatter""", 4, extra)
    ring = 3 * 1e-6 + 400 * 50 * 4 * 3 / 4 / 1e9
    got = predict(text, ROUND)
    assert got.comm_s == pytest.approx(ring, rel=1e-12) and got.seconds == got.exposed_comm_s == got.comm_s


def test_a_combined_all_reduce_moves_every_operand():
    extra = ADD
    text = module("""
  x = f32[100,50]{1,0} parameter(0)
  y = f32[300,50]{1,0} parameter(1)
  ROOT r = (f32[100,50]{1,0}, f32[300,50]{1,0}) all-reduce(x, y), replica_groups={{0,1,2,3}}, to_apply=add""",
                  4, extra)
    ring = 3 * 1e-6 + 400 * 50 * 4 * 3 / 4 / 1e9  # a reduce-scatter and an all-gather of both operands
    assert predict(text, ROUND).comm_s == pytest.approx(2 * ring, rel=1e-12)


def test_an_asynchronous_copy_overlaps_as_memory_not_communication():
    """TPU's DMAs (``copy-start`` / ``copy-done``): what they copy, read and written, hidden behind what runs
    meanwhile, and never counted as communication."""
    text = module("""
  x = f32[100,200]{1,0} parameter(0)
  w = f32[200,50]{1,0} parameter(1)
  s = (f32[100,200]{1,0}, f32[100,200]{1,0}, u32[]) copy-start(x)
  d = f32[100,50]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  c = f32[100,200]{1,0} copy-done(s)
  ROOT t = (f32[100,50]{1,0}, f32[100,200]{1,0}) tuple(d, c)""", 1)
    copy = 2 * 100 * 200 * 4 / 1e11  # 1.6 µs: hidden behind the 2 µs product
    got = predict(text, ROUND)
    assert copy < DOT and got.seconds == pytest.approx(DOT, rel=1e-12) and got.comm_s == 0.0
    slow = ROUND.model_copy(update={"memory_bytes_per_s": 1e10})  # now 16 µs, the product memory-bound at 14 µs
    assert predict(text, slow).seconds == pytest.approx(2 * 100 * 200 * 4 / 1e10, rel=1e-12)
    assert predict(text, slow).compute_s == predict(text, slow).seconds
