"""Discovery on the modules accelerator backends print: real module texts from XLA's own test suites
(tests/collective_matmul/data/xla_modules, each source named in its README) and the forms they use: XLA's
windowed-einsum loops, convolutions that are matmuls, GEMM custom calls, fused dots, async wrappers, FP8."""
# ruff: noqa: E501 -- the module texts are printed as XLA prints them

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collective_matmul.programs.discovery import products, scan
from collective_matmul.programs.hlo import parse_module

DATA = Path(__file__).parent / "data" / "xla_modules"
MODULES = sorted(DATA.glob("*.hlo"))


def read(name: str) -> str:
    return (DATA / f"{name}.hlo").read_text()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_every_module_parses_and_every_operand_is_an_instruction_of_its_computation(path):
    module = parse_module(path.read_text())
    assert module.entry is not None and module.entry.instructions
    for comp in module.computations.values():
        for inst in comp.instructions.values():
            assert all(o in comp.instructions for o in inst.operands), (comp.name, inst.name, inst.operands)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_a_module_with_a_collective_next_to_a_product_is_never_passed_over_in_silence(path):
    """Where a collective and a matrix product meet, discovery lists a problem, what XLA decomposed, a skipped
    collective with its reason, or a warning: never nothing."""
    text = path.read_text()
    module = parse_module(text)
    collective = re.search(r"\b(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)", text)
    found = scan(module)
    if collective and products(module):
        assert found.problems or found.decomposed or found.skipped or found.warnings, path.stem


def test_xlas_windowed_einsum_loops_are_named_with_the_problem_they_decompose():
    gather = scan(read("windowed_einsum_ag_loop_bf16"))
    (loop,) = gather.decomposed
    assert loop.problem == "allgather_matmul:2048x24576x98304:bfloat16:4"
    assert "XLA's windowed einsum (gather)" in loop.what and "a ring of 4" in loop.what
    assert [p.problem.key for p in gather.problems] == [loop.problem]  # still listed, to be tuned against XLA's
    scatter = scan(read("windowed_einsum_rs_loop_bf16"))
    (loop,) = scatter.decomposed
    # its permutes move partial sums two devices at a time; the ring is the rows of the whole over a block's
    assert loop.problem == "matmul_reduce_scatter:2048x98304x24576:bfloat16:4"
    consumers = scan(read("windowed_einsum_ag_loop_multiple_consumers_bf16"))
    (problem,) = consumers.problems  # the loop and a plain all-gather -> dot of the same shape
    assert problem.problem.key == consumers.decomposed[0].problem and problem.count == 2


def test_a_windowed_einsum_over_the_contracting_dimension_and_fp8_loops_say_why_they_have_no_problem():
    sharded = scan(read("windowed_einsum_ag_loop_sharded_contracting_dim_bf16"))
    assert sharded.decomposed[0].problem is None and not sharded.problems
    assert any("contracting dimension" in w for w in sharded.warnings)
    assert any("weight gradient of another layout" in s.reason for s in sharded.skipped)
    for name in ("windowed_einsum_ag_loop_fp8_dequant", "windowed_einsum_rs_loop_fp8_dequant"):
        found = scan(read(name))
        assert found.decomposed[0].problem is None and not found.problems
        assert any("f8e4m3fn values dequantized" in w for w in found.warnings), name


def test_fp8_dequantized_before_the_product_is_skipped_with_its_8_bit_type():
    found = scan(read("windowed_einsum_ag_multiple_consumers_fp8"))
    reasons = [s.reason for s in found.skipped]
    assert len(reasons) == 2 and all("reads f8e4m3fn values dequantized by a scale" in r for r in reasons)
    assert not found.problems


def test_an_all_to_all_and_a_gathered_8_bit_weight_are_skipped_with_the_reason():
    (a2a,) = scan(read("all_to_all_then_dot_bf16")).skipped
    assert "all-to-all feeds the product" in a2a.reason
    (weight,) = scan(read("pipelined_loop_ag_then_dot_fp8_dequant")).skipped  # FSDP's gather, of f8 values
    assert weight.what.startswith("all-gather") and "reads f8e4m3fn values dequantized" in weight.reason


def test_products_read_gemm_custom_calls_fused_dots_and_convolutions_that_are_matmuls():
    (gemm, _), = products(parse_module(read("cublas_gemm_custom_call_f32")))
    assert gemm.name == "get-tuple-element" and gemm.operands == ("arg0", "arg1")  # the call's first result
    assert gemm.ints("lhs_contracting_dims") == (1,) and gemm.ints("rhs_contracting_dims") == (0,)
    (fused, _), = products(parse_module(read("triton_gemm_fusion_bf16_s8")))
    assert fused.name == "fusion" and fused.operands == ("p0", "p1")  # the dot's parameters, through converts
    (conv, _), = products(parse_module(read("spmd_tiled_dot_as_convolution_bf_io")))
    assert conv.opcode == "dot" and conv.ints("lhs_contracting_dims") and conv.ints("rhs_contracting_dims")
    warnings: list[str] = []
    assert not products(parse_module(read("cublas_gemm_chain_with_async_all_reduce_f32")), warnings)
    assert len(warnings) == 7 and all("no dot_dimension_numbers" in w for w in warnings)  # never silence
    warnings = []
    products(parse_module(read("while_loop_output_fusions_conv_bf_io_s8_weights")), warnings)
    assert warnings and all("computed inside the fusion" in w for w in warnings)


ASYNC_AND_GEMM = """HloModule m, num_partitions=4

rs_body {
  p = bf16[1024,512]{1,0} parameter(0)
  ROOT rs = bf16[256,512]{1,0} reduce-scatter(p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=add
}

ag_body {
  q = bf16[256,512]{1,0} parameter(0)
  ROOT ag = bf16[1024,512]{1,0} all-gather(q), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
}

add {
  a = bf16[] parameter(0)
  b = bf16[] parameter(1)
  ROOT c = bf16[] add(a, b)
}

ENTRY main {
  x = bf16[1024,256]{1,0} parameter(0)
  w = bf16[256,512]{1,0} parameter(1)
  down = bf16[1024,512]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/down/dot_general"}
  start = ((bf16[1024,512]{1,0}), bf16[256,512]{1,0}) async-start(down), calls=rs_body
  done = bf16[256,512]{1,0} async-done(start)
  gs = ((bf16[256,512]{1,0}), bf16[1024,512]{1,0}) async-start(done), calls=ag_body
  gd = bf16[1024,512]{1,0} async-done(gs)
  v = bf16[512,128]{1,0} parameter(2)
  gemm = (bf16[1024,128]{1,0}, s8[4096]{0}) custom-call(gd, v),
    custom_call_target="__cublas$lt$matmul",
    backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],
      "rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}},
    metadata={op_name="jit(f)/up/dot_general"}
  ROOT up = bf16[1024,128]{1,0} get-tuple-element(gemm), index=0
}
"""


def test_async_wrapped_collectives_and_a_cublaslt_gemm_are_collective_matmuls():
    found = scan(ASYNC_AND_GEMM, {"model": 4})
    keys = {p.role: (p.problem.key, p.axis) for p in found.problems if p.slot == "forward"}
    assert keys == {"down": ("matmul_reduce_scatter:1024x1024x512:bfloat16:4", "model"),
                    "up": ("allgather_matmul:1024x512x512:bfloat16:4", "model")}


# Two asynchronous all-gathers feeding a convolution with a real window, in the form XLA's latency-hiding
# scheduler tests use (a strided, dilated window: no matrix product); written here, not copied.
GATHERED_CONVOLUTION = """HloModule gathered_convolution, num_partitions=2

ENTRY main {
  p0 = f32[8,64,256]{2,1,0} parameter(0)
  p1 = f32[8,64,256]{2,1,0} parameter(1)
  ag0 = (f32[8,64,256]{2,1,0}, f32[16,64,256]{2,1,0}) all-gather-start(p0), replica_groups={{0,1}}, dimensions={0}, metadata={op_type="AllGather" op_name="jit(step)/conv/all_gather"}
  ag1 = (f32[8,64,256]{2,1,0}, f32[16,64,256]{2,1,0}) all-gather-start(p1), replica_groups={{0,1}}, dimensions={0}, metadata={op_type="AllGather" op_name="jit(step)/conv/all_gather"}
  d0 = f32[16,64,256]{2,1,0} all-gather-done(ag0)
  d1 = f32[16,64,256]{2,1,0} all-gather-done(ag1)
  ROOT c0 = f32[16,256,256]{2,1,0} convolution(d0, d1), window={size=16 stride=15 lhs_dilate=16}, dim_labels=0fb_0io->0fb, metadata={op_type="conv_general_dilated" op_name="jit(step)/conv/conv_general_dilated"}
}
"""


def test_gathered_operands_of_a_convolution_that_is_no_matmul_are_skipped_with_the_reason():
    module = parse_module(GATHERED_CONVOLUTION)
    assert products(module) == []  # not a product
    found = scan(module)
    assert not found.problems
    assert {s.what for s in found.skipped} == {"all-gather-start ag0 -> c0", "all-gather-start ag1 -> c0"}
    assert all("convolution that is not a matrix product (window {size=16 stride=15 lhs_dilate=16})" in s.reason
               and s.role == "conv" for s in found.skipped)
    assert found.seen == {"products": 0, "all-gather": 2}  # what an empty answer says it looked at
