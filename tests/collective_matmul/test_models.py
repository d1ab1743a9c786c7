"""Model shapes → problems, checked against a small hand-computed model."""

import pytest
from pydantic import ValidationError

from collective_matmul import Problem
from collective_matmul.planning.models import PRESETS, MeshSpec, TransformerBlock, model_problems


def by_key(problems):
    return {mp.problem.key: (mp.count, mp.roles) for mp in problems}


def test_hand_computed_small_model():
    # d_model 64, 2 heads of 16 (attention width 32), d_ff 128, gated; batch 8 over data=2
    model = TransformerBlock(d_model=64, d_ff=128, heads=2, head_dim=16, gated_mlp=True,
                             seq_len=16, global_batch=8, dtype="float32")
    mesh = MeshSpec.parse("data=2,model=4")
    # tokens per ring = 8 / 2 * 16 = 64; qkv width = 3 * 32 = 96; gated up width = 256.
    # Weight gradients contract the tokens: all-gather roles dW = all_gather(x)^T dy (k=K, n=N);
    # reduce-scatter roles dW^T = all_gather(dy)^T x (k=N, n=K).
    assert by_key(model_problems(model, mesh)) == {
        "allgather_matmul:64x64x96:float32:4": (1, ("qkv",)),
        "matmul_reduce_scatter:64x96x64:float32:4": (1, ("qkv.grad_input",)),
        "allgather_grad_weight:64x64x96:float32:4": (1, ("qkv.grad_weight",)),
        "matmul_reduce_scatter:64x32x64:float32:4": (1, ("attn_out",)),
        "allgather_matmul:64x64x32:float32:4": (1, ("attn_out.grad_input",)),
        "allgather_grad_weight:64x64x32:float32:4": (1, ("attn_out.grad_weight",)),
        "allgather_matmul:64x64x256:float32:4": (1, ("mlp_up",)),
        "matmul_reduce_scatter:64x256x64:float32:4": (1, ("mlp_up.grad_input",)),
        "allgather_grad_weight:64x64x256:float32:4": (1, ("mlp_up.grad_weight",)),
        "matmul_reduce_scatter:64x128x64:float32:4": (1, ("mlp_down",)),
        "allgather_matmul:64x64x128:float32:4": (1, ("mlp_down.grad_input",)),
        "allgather_grad_weight:64x64x128:float32:4": (1, ("mlp_down.grad_weight",)),
    }


def test_ungated_mlp_dedups_up_and_down_gradient():
    model = TransformerBlock(d_model=64, d_ff=128, heads=4, head_dim=16, kv_heads=2,
                             seq_len=8, global_batch=4, dtype="bfloat16")
    found = by_key(model_problems(model, MeshSpec.parse("model=8")))
    # qkv with grouped KV heads: (4 + 2*2) * 16 = 128 = d_ff, so qkv and mlp_up coincide too
    assert found["allgather_matmul:32x64x128:bfloat16:8"] == (3, ("qkv", "mlp_up", "mlp_down.grad_input"))
    assert found["matmul_reduce_scatter:32x128x64:bfloat16:8"] == (
        3, ("qkv.grad_input", "mlp_up.grad_input", "mlp_down"))
    # mlp_down's dW^T [d_model, d_ff] has the shape of qkv's and mlp_up's dW [d_model, 128]
    assert found["allgather_grad_weight:32x64x128:bfloat16:8"] == (
        3, ("qkv.grad_weight", "mlp_up.grad_weight", "mlp_down.grad_weight"))
    assert found["allgather_grad_weight:32x64x64:bfloat16:8"] == (1, ("attn_out.grad_weight",))
    assert sum(count for count, _ in found.values()) == 12


def test_presets_give_valid_problems():
    problems = model_problems(PRESETS["llama2-70b"], MeshSpec.parse("data=16,model=8"))
    keys = by_key(problems)
    # 1024 sequences / 16 * 4096 tokens; GQA qkv = (64 + 16) * 128 = 10240; SwiGLU up = 2 * 28672
    assert "allgather_matmul:262144x8192x10240:bfloat16:8" in keys
    assert "allgather_matmul:262144x8192x57344:bfloat16:8" in keys
    assert keys["allgather_grad_weight:262144x8192x10240:bfloat16:8"] == (1, ("qkv.grad_weight",))
    # mlp_down: x [tokens, d_ff], w [d_ff, d_model]; dW^T = all_gather(dy)^T x is [d_model, d_ff]
    assert keys["allgather_grad_weight:262144x8192x28672:bfloat16:8"] == (1, ("mlp_down.grad_weight",))
    assert sum(mp.count for mp in problems) == 12
    tiny = model_problems(PRESETS["tiny"], MeshSpec.parse("data=1,model=8"))
    assert all(mp.problem.m == 512 for mp in tiny)


@pytest.mark.parametrize(
    "mesh, message",
    [
        ("data=3,model=8", "global_batch=4 is not divisible by the 3 data-parallel shards"),
        ("data=1,model=3", "not divisible by axis_size=3"),
    ],
)
def test_indivisible_model_raises(mesh, message):
    with pytest.raises(ValueError, match=message):
        model_problems(PRESETS["tiny"], MeshSpec.parse(mesh))


def test_mesh_parse():
    assert MeshSpec.parse("data=2,model=4").axes == {"data": 2, "model": 4}
    assert MeshSpec.parse("x=2,y=4").tensor_axis == "y"
    with pytest.raises(ValueError, match="name=size"):
        MeshSpec.parse("data:2")
    with pytest.raises(ValidationError, match="tensor_axis 'tp' is not a mesh axis"):
        MeshSpec.parse("data=2", tensor_axis="tp")
    with pytest.raises(ValueError, match="names axis 'model' twice: give each axis once"):
        MeshSpec.parse("model=8,model=2")  # not the last value silently
    assert Problem.parse("ag:64x64x96:float32:4").m == 64


def test_a_slot_label_reads_back_and_a_slot_names_its_collective():
    from collective_matmul.planning.models import SLOTS, parse_slot_label, slot_collective, slot_label

    for role in ("mlp_up", "Block_0/Dense_0", "model.py:12"):  # a role may hold dots of its own
        assert [parse_slot_label(slot_label(role, slot)) for slot in SLOTS] == [(role, slot) for slot in SLOTS]
    assert slot_label("mlp_up", "forward") == "mlp_up" and parse_slot_label("mlp_up.forward") == ("mlp_up", "forward")
    assert [slot_collective("allgather_matmul", slot) for slot in SLOTS] == [
        "allgather_matmul", "matmul_reduce_scatter", "allgather_grad_weight"]
    assert slot_collective("matmul_reduce_scatter", "grad_input") == "allgather_matmul"
    with pytest.raises(ValueError, match="collective must be one of"):
        slot_collective("allgather_grad_weight", "forward")


def test_the_slots_of_a_weight_gathered_product_are_fsdps_own_collectives():
    """A weight gathered on k: dx gathers it again as, transposed, a weight gathered on n, and dW is reduce-scattered
    onto its rows; gathered on n, the reverse, dW transposed."""
    from collective_matmul.planning.models import WEIGHT_K, WEIGHT_N, slot_problems

    k_slots = slot_problems(WEIGHT_K, m=4096, k=1024, n=512, dtype="bfloat16", axis_size=8)
    assert {slot: p.key for slot, p in k_slots.items()} == {
        "forward": "weight_allgather_matmul_k:4096x1024x512:bfloat16:8",
        "grad_input": "weight_allgather_matmul_n:4096x512x1024:bfloat16:8",
        "grad_weight": "reduce_scatter_grad_weight:4096x1024x512:bfloat16:8"}
    n_slots = slot_problems(WEIGHT_N, m=4096, k=1024, n=512, dtype="bfloat16", axis_size=8)
    assert {slot: p.key for slot, p in n_slots.items()} == {
        "forward": "weight_allgather_matmul_n:4096x1024x512:bfloat16:8",
        "grad_input": "weight_allgather_matmul_k:4096x512x1024:bfloat16:8",
        "grad_weight": "reduce_scatter_grad_weight:4096x512x1024:bfloat16:8"}
