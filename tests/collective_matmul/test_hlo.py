"""The HLO reader and the scan of a module's text: the forms accelerator backends print, without compiling."""
# ruff: noqa: E501 -- the module texts are printed as XLA prints them, one instruction per line

from __future__ import annotations

import pytest

from collective_matmul.programs.discovery import scan
from collective_matmul.programs.hlo import parse_module, replica_groups

# What a GPU backend prints for a column-parallel and a row-parallel projection inside a scanned layer:
# an asynchronous all-gather (start/done), a reduce-scatter already fused by XLA, a loop of 3 layers,
# a K/V gather feeding an attention product, and the stack frames of the calls.
ACCELERATOR_MODULE = """HloModule jit_step, entry_computation_layout={()->()}, num_partitions=8

FileNames
1 "/home/user/model.py"
2 "/site-packages/flax/nnx/nn/linear.py"

FunctionNames
1 "Block.__call__"
2 "Linear.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=40 end_line=40 column=4 end_column=4}
2 {file_name_id=2 function_name_id=2 line=287 end_line=287 column=4 end_column=4}
3 {file_name_id=1 function_name_id=1 line=44 end_line=44 column=4 end_column=4}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=1}

%body (p: (s32[], bf16[2,128,1024], bf16[1024,512], bf16[512,1024])) -> (s32[], bf16[2,128,1024], bf16[1024,512], bf16[512,1024]) {
  %p = (s32[], bf16[2,128,1024]{2,1,0}, bf16[1024,512]{1,0}, bf16[512,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,128,1024]{2,1,0} get-tuple-element(%p), index=1
  %w_up = bf16[1024,512]{1,0} get-tuple-element(%p), index=2
  %w_down = bf16[512,1024]{1,0} get-tuple-element(%p), index=3
  %ags = (bf16[2,128,1024]{2,1,0}, bf16[2,512,1024]{2,1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true
  %agd = bf16[2,512,1024]{2,1,0} all-gather-done(%ags)
  %up = bf16[2,512,512]{2,1,0} dot(%agd, %w_up), lhs_contracting_dims={2}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(layers)/while/body/up/dot_general" stack_frame_id=2}
  %down = bf16[2,512,1024]{2,1,0} dot(%up, %w_down), lhs_contracting_dims={2}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(layers)/while/body/down/dot_general" stack_frame_id=3}
  %rs = bf16[2,128,1024]{2,1,0} reduce-scatter(%down), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, to_apply=%add
  %kv = bf16[2,4,128,64]{3,2,1,0} all-gather(%x.kv), channel_id=3, replica_groups=[2,4]<=[8], dimensions={2}
  %x.kv = bf16[2,4,32,64]{3,2,1,0} parameter(1)
  %scores = f32[2,4,128,128]{3,2,1,0} dot(%kv, %kv), lhs_batch_dims={0,1}, rhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_contracting_dims={3}, metadata={op_name="jit(step)/jvp(layers)/while/body/attention/dot_general"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[2,128,1024]{2,1,0}, bf16[1024,512]{1,0}, bf16[512,1024]{1,0}) tuple(%next, %rs, %w_up, %w_down)
}

%cond (p.1: (s32[], bf16[2,128,1024], bf16[1024,512], bf16[512,1024])) -> pred[] {
  %p.1 = (s32[], bf16[2,128,1024]{2,1,0}, bf16[1024,512]{1,0}, bf16[512,1024]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: bf16[2,128,1024], b: bf16[1024,512], c: bf16[512,1024]) -> bf16[2,128,1024] {
  %a = bf16[2,128,1024]{2,1,0} parameter(0)
  %b = bf16[1024,512]{1,0} parameter(1)
  %c = bf16[512,1024]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,128,1024]{2,1,0}, bf16[1024,512]{1,0}, bf16[512,1024]{1,0}) tuple(%zero, %a, %b, %c)
  %loop = (s32[], bf16[2,128,1024]{2,1,0}, bf16[1024,512]{1,0}, bf16[512,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %y = bf16[2,128,1024]{2,1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_module_of_an_accelerator_backend_yields_its_projections():
    found = scan(ACCELERATOR_MODULE, {"data": 2, "model": 4})
    keys = {(p.role, p.slot): (p.problem.key, p.count, p.axis, p.source) for p in found.problems}
    # the asynchronous all-gather of the rows feeds the up projection: m = 2 x 512 rows per ring, n = 4 x 512
    assert keys[("layers/up", "forward")] == ("allgather_matmul:1024x1024x2048:bfloat16:4", 3, "model", "model.py:40")
    # the fused reduce-scatter of the down projection's rows: k = 4 x 512
    assert keys[("layers/down", "forward")] == ("matmul_reduce_scatter:1024x2048x1024:bfloat16:4", 3, "model",
                                                "model.py:44")
    assert set(keys) == {("layers/up", "forward"), ("layers/down", "forward")}  # no backward in this module
    (skipped,) = found.skipped
    assert skipped.role == "layers/attention" and "attention-like" in skipped.reason and skipped.count == 3


def test_module_structure_trip_counts_and_frames():
    module = parse_module(ACCELERATOR_MODULE)
    assert module.num_partitions == 8 and module.entry.name == "main"
    assert module.executions["body"] == (3, True)
    loop = module.computations["main"].instructions["loop"]
    assert module.trip_count(loop) == 3
    up = module.computations["body"].instructions["up"]
    assert [(f.file.rsplit("/", 1)[-1], f.line) for f in module.stack(up.stack_frame_id)] == [
        ("linear.py", 287), ("model.py", 40)]  # the Flax frame, then the user's call
    assert up.ints("lhs_contracting_dims") == (2,) and up.shape.dims == (2, 512, 512)
    assert module.computations["body"].instructions["ags"].shape.is_tuple


@pytest.mark.parametrize("attributes, groups", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("replica_groups=[2,4]<=[8]", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [(0, 4), (1, 5), (2, 6), (3, 7)]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1'}", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_0'}", [(0, 4), (1, 5), (2, 6), (3, 7)]),
    # device ids [0, 4, 1, 5, 2, 6, 3, 7] laid out as the mesh's axes (as XLA printed it for a data=2, model=4 mesh)
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}",
     [(0, 4), (1, 5), (2, 6), (3, 7)]),
    ("replica_groups={}", [tuple(range(8))]),
    ("replica_groups=something-new", None),
])
def test_replica_groups_in_every_format(attributes, groups):
    assert replica_groups(attributes, 8) == groups


def test_a_reduction_that_is_not_scattered_is_skipped_with_the_reason_and_a_weight_gather_is_fsdps():
    text = """HloModule m, num_partitions=4

ENTRY %main (x: f32[8,64,32], w: f32[32,64], v: f32[16,32]) -> f32[8,64,32] {
  %x = f32[8,64,32]{2,1,0} parameter(0)
  %w = f32[32,64]{1,0} parameter(1)
  %v = f32[16,32]{1,0} parameter(2)
  %p = f32[8,64,32]{2,1,0} dot(%x, %w.t), lhs_contracting_dims={2}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/tp_only/dot_general"}
  %w.t = f32[32,32]{1,0} parameter(3)
  %ar = f32[8,64,32]{2,1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %g = f32[64,32]{1,0} all-gather(%v), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %q = f32[8,64,64]{2,1,0} dot(%ar, %g), lhs_contracting_dims={2}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/fsdp/dot_general"}
}
"""
    found = scan(text)
    (fsdp,) = found.problems  # the weight gathered on its output dimension; no backward in this module
    assert (fsdp.role, fsdp.slot, fsdp.problem.key) == ("fsdp", "forward", "weight_allgather_matmul_n:2048x32x64:float32:4")
    reasons = {s.role: s.reason for s in found.skipped}
    assert "tensor parallelism without sequence parallelism" in reasons["tp_only"] and "fsdp" not in reasons


def test_text_that_is_not_a_module_is_refused():
    with pytest.raises(ValueError, match="no computation"):
        parse_module("this is not HLO")


def test_a_tuple_element_written_in_place_is_read_as_its_get_tuple_element():
    """XLA 0.12's partitioned modules write ``%param.1#0`` for element 0 of a tuple operand: a scan's loop
    condition in that form still gives its trip count."""
    text = """HloModule loop, num_partitions=1

cond (param.1: (s32[], f32[4])) -> pred[] {
  %param.1 = (s32[], f32[4]{0}) parameter(0)
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%param.1#0, %limit), direction=LT
}

body (param.2: (s32[], f32[4])) -> (s32[], f32[4]) {
  %param.2 = (s32[], f32[4]{0}) parameter(0)
  %one = s32[] constant(1)
  %next = s32[] add(%param.2#0, %one)
  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %param.2#1)
}

ENTRY main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %x)
  ROOT %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
}
"""
    module = parse_module(text)
    element = module.computations["cond"].instructions["param.1#0"]
    assert (element.opcode, element.operands, element.attribute("index")) == ("get-tuple-element", ("param.1",), "0")
    assert element.shape.dtype == "s32" and module.computations["body"].instructions["param.2#1"].shape.dims == (4,)
    assert module.trip_count(module.entry.instructions["loop"]) == 3
    assert module.executions["body"] == (3, True)


def test_a_trip_count_through_a_copied_counter_and_operands_after_an_index_comment():
    """XLA's TPU compiler copies the loop counter's initial constant and writes ``/*index=5*/`` before the sixth
    operand of a tuple: the counter is still read from the constant, the operand by its name."""
    module = parse_module("""
HloModule m, is_scheduled=true

cond {
  p = (s32[], s32[], s32[], s32[], s32[], s32[]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  three = s32[] constant(3)
  ROOT lt = pred[] compare(i, three), direction=LT
}

body {
  p = (s32[], s32[], s32[], s32[], s32[], s32[]) parameter(0)
  ROOT t = (s32[], s32[], s32[], s32[], s32[], s32[]) tuple(p)
}

ENTRY e {
  zero = s32[] constant(0)
  start = s32[] copy(zero)
  x = s32[] parameter(0)
  init = (s32[], s32[], s32[], s32[], s32[], s32[]) tuple(start, x, x, x, x, /*index=5*/x)
  ROOT w = (s32[], s32[], s32[], s32[], s32[], s32[]) while(init), condition=cond, body=body
}
""")
    loop = module.entry.instructions["w"]
    assert module.trip_count(loop) == 3 and module.entry.instructions["init"].operands[5] == "x"
