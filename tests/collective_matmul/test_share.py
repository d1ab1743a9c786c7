"""One gather for every projection that reads it (`collective_matmul.ops.share`): q/k/v and gate/up of one normed
activation run one ring (or all-gather) and one reduce-scatter of their summed input gradients, with the values
and gradients of the step as written; a projection of another value or another layout gathers for itself."""

from __future__ import annotations

import importlib
import re
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import Decomposition, OpConfigs, Tuned
from collective_matmul.client import flax as cm_flax
from collective_matmul.ops.collective import allgather_matmul_keep, gathered_matmul
from collective_matmul.ops.share import SharedGather
from collective_matmul.programs.roles import group_label

D = Decomposition.from_id
BATCH, SEQ, D_MODEL, HEADS, HEAD_DIM, D_FF = 4, 32, 32, 4, 8, 64
COLUMN = OpConfigs(forward=D("ring-bi-c1-full-dus"), grad_input=D("ring-uni-c1-full-in"))
ROW = OpConfigs(forward=D("ring-uni-c1-full-in"), grad_input=D("ring-bi-c1-full-dus"))


def mesh_2d():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("configs", [OpConfigs(), COLUMN, OpConfigs(forward=D("ring-uni-c2-full-dus"),
                                                                      grad_input=D("ring-bi-c2-full-in"),
                                                                      grad_weight=D("baseline"))],
                         ids=["baseline", "rings", "rings-chunked-unfused"])
@pytest.mark.parametrize("grouped", [True, False], ids=["group", "no-group"])
def test_three_products_of_one_gather_equal_float64(configs, grouped):
    """The op pair: one gathering op and two local products of what it gathered; the value and every gradient
    equal float64 numpy, and the backward holds one reduce-scatter (or one ring) for all three input gradients.
    With their `SharedGather` (what the drop-in passes) the readers' input-gradient products run inside that one ring:
    each of its pieces (a ring of 4, x chunks) is three products, where without the group the readers' two are
    whole products before the ring."""
    mesh = mesh_2d()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL))
    ws = [rng.standard_normal((D_MODEL, n)) for n in (32, 16, 16)]
    cots = [rng.standard_normal((BATCH, SEQ, w.shape[1])) for w in ws]

    def loss(x, ws, grouped=grouped):
        group = SharedGather("q") if grouped else None
        y, stack = allgather_matmul_keep(x, ws[0], mesh=mesh, axis="model", batch_axis="data", config=configs.forward,
                                         grad_input=configs.grad_input, grad_weight=configs.grad_weight, group=group)
        ys = [y, *(gathered_matmul(stack, w, mesh=mesh, axis="model", batch_axis="data", group=group)
                   for w in ws[1:])]
        return sum(jnp.sum(y * c) for y, c in zip(ys, cots, strict=True))

    put = lambda a, *spec: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = put(x, "data", "model", None), [put(w, None, "model") for w in ws]
    value, (dx, dws) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)
    want = sum(float(np.sum(np.einsum("bmk,kn->bmn", x, w) * c)) for w, c in zip(ws, cots, strict=True))
    assert abs(float(value) - want) <= 1e-5 * abs(want)
    assert rel_error(dx, sum(np.einsum("bmn,kn->bmk", c, w) for w, c in zip(ws, cots, strict=True))) <= 1e-5
    for dw, c in zip(dws, cots, strict=True):
        assert rel_error(dw, np.einsum("bmk,bmn->kn", x, c)) <= 1e-5
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    if grouped:  # the readers' input-gradient products run piece by piece in every step of the ring
        alone = jax.jit(jax.grad(partial(loss, grouped=False), argnums=(0, 1))).lower(*args).compile().as_text()
        pieces = 1 if configs.grad_input.method == "baseline" else 4 * configs.grad_input.chunks
        assert products(text) - products(alone) == 2 * (pieces - 1), (products(alone), products(text))
    if configs.grad_input.method == "baseline":  # the input gradients summed, then scattered once
        assert text.count(" reduce-scatter(") == 1
    else:  # one ring of P-1 hops (x chunks, x 2 streams) brings the summed input gradient
        hops = 3 * configs.grad_input.chunks
        forward = 3 * configs.forward.chunks  # the gathering ring (bidirectional: 2 + 1 hops; one way: 3)
        regather = 0 if configs.grad_weight.fuse else 1  # the unfused weight gradient gathers x again
        assert text.count("collective-permute(") == forward + hops and text.count(" all-gather(") == regather


@pytest.mark.parametrize("used", [(1, 2), (0,), (0, 2)], ids=["readers-only", "first-only", "first-and-one"])
def test_a_group_whose_outputs_are_partly_unused_has_the_gradient_of_what_is_used(used):
    """Autodiff skips the backward of an output nobody uses: the group's one ring sums what the used products
    hand over, and the input gradient equals float64 for whichever products the loss reads; a vjp applied
    twice (eagerly) gives the same gradient twice."""
    mesh = mesh_2d()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, SEQ, D_MODEL))
    ws = [rng.standard_normal((D_MODEL, n)) for n in (32, 16, 16)]
    cots = [rng.standard_normal((BATCH, SEQ, w.shape[1])) for w in ws]
    where = dict(mesh=mesh, axis="model", batch_axis="data")

    def outputs(x, ws):
        group = SharedGather("q")
        y, stack = allgather_matmul_keep(x, ws[0], **where, config=COLUMN.forward, grad_input=COLUMN.grad_input,
                                         group=group)
        return [y, *(gathered_matmul(stack, w, **where, group=group) for w in ws[1:])]

    def loss(x, ws):
        return sum(jnp.sum(y * cots[i]) for i, y in enumerate(outputs(x, ws)) if i in used)

    put = lambda a, *spec: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = put(x, "data", "model", None), [put(w, None, "model") for w in ws]
    want = sum(np.einsum("bmn,kn->bmk", cots[i], ws[i]) for i in used)
    assert rel_error(jax.jit(jax.grad(loss))(*args), want) <= 1e-5
    _, vjp = jax.vjp(lambda x: loss(x, args[1]), args[0])
    assert rel_error(vjp(jnp.float32(1))[0], want) <= 1e-5 and rel_error(vjp(jnp.float32(1))[0], want) <= 1e-5


def products(text: str) -> int:
    """The matrix products of a compiled module (the CPU backend writes them as dots)."""
    return len(re.findall(r" dot\(", text))


class Layer(nn.Module):
    """A Llama-shaped layer: RMSNorm -> separate q/k/v (heads x head_dim), -> out; RMSNorm -> SwiGLU gate/up ->
    down; and ``side``: a projection of the same normed value on another layout (no batch axis), which must
    gather for itself."""

    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x, _):
        def dense(features, kind, spec, name, *, axis=-1, batch_axis=cm_flax.AUTO):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), spec)
            return nn.DenseGeneral(features, axis=axis, use_bias=False, kernel_init=init, name=name,
                                   dot_general=cm_flax.dot_general(self.tuned, mesh=self.mesh, kind=kind,
                                                                   batch_axis=batch_axis))

        shard = lambda y, *spec: jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, P(*spec)))  # noqa: E731
        h = nn.RMSNorm(name="attn_norm")(x)
        q, k, v = (shard(dense((HEADS, HEAD_DIM), "column", (None, "model", None), name)(h), "data", None, "model",
                         None) for name in ("query", "key", "value"))
        side = dense(HEADS, "column", (None, "model"), "side", batch_axis=None)(h)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM) + side.transpose(0, 2, 1)[:, :, None, :]
        o = shard(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v), "data", None, "model", None)
        x = x + shard(dense(D_MODEL, "row", ("model", None, None), "out", axis=(-2, -1))(o), "data", "model", None)
        h = nn.RMSNorm(name="mlp_norm")(x)
        gate = shard(dense(D_FF, "column", (None, "model"), "gate")(h), "data", None, "model")
        up = shard(dense(D_FF, "column", (None, "model"), "up")(h), "data", None, "model")
        return x + shard(dense(D_MODEL, "row", ("model", None), "down")(nn.silu(gate) * up), "data", "model",
                         None), None


class Model(nn.Module):
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                         metadata_params={nn.PARTITION_NAME: None})
        return layers(self.mesh, self.tuned, name="layers")(x, None)[0]


def loss_and_grads(mesh, tuned, params, x):
    model = Model(mesh, tuned)
    return jax.jit(jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2)))(params)


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def counts(mesh, tuned, params, x) -> dict[str, int]:
    text = jax.jit(lambda p: loss_and_grads(mesh, tuned, p, x)).lower(params).compile().as_text()
    return {op: text.count(f" {op}(") for op in COLLECTIVES}


def rings(tuned: Tuned, *, share: bool = True) -> Tuned:
    variant = tuned.variant("rings", lambda role, configs: ROW if role.endswith(("out", "down")) else COLUMN)
    variant.share = share
    return variant


@pytest.mark.slow  # a Llama layer's float64 gradients and four compiles (12 s); the op-level float64 test above is fast
def test_a_llama_layer_shares_its_gathers_and_equals_float64():
    mesh = mesh_2d()
    model = Model(mesh)
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, SEQ, D_MODEL)), jnp.float32),
                       NamedSharding(mesh, P("data", "model", None)))
    specs = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x))
    params = jax.jit(lambda k: nn.unbox(model.init(k, x)),
                     out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))(jax.random.key(0))
    tuned = rings(Tuned())
    value, grads = loss_and_grads(mesh, tuned, params, x)
    with jax.enable_x64(True):
        as64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)  # noqa: E731
        want_value, want_grads = loss_and_grads(mesh, None, as64(params), as64(x))
    assert abs(float(value) - float(want_value)) <= 1e-5 * abs(float(want_value))
    errors = jax.tree.leaves(jax.tree.map(rel_error, grads, want_grads))
    assert len(errors) == 10 and max(errors) <= 1e-5, errors

    report = tuned.report()
    assert report.groups == {"layers/query": ["layers/key", "layers/value"], "layers/gate": ["layers/up"]}
    side = next(s for s in report if s.role == "layers/side")  # the same value, another layout: its own gather
    assert side.applied and not side.gathered_by
    assert "layers/key" in str(report) and "reuses the gather of layers/query" in str(report)
    assert "2 gather(s) shared: layers/query gathers for layers/key, layers/value" in str(report)
    summed = {s.role: s for s in report if s.members}  # each group's summed input gradient, found as one problem
    assert sorted(summed) == ["layers/{gate,up}", "layers/{key,query,value}"]
    assert summed["layers/{key,query,value}"].problems["grad_input"].key == "matmul_reduce_scatter:64x96x32:float32:4"
    assert summed["layers/{gate,up}"].runs["grad_input"].decomposition == COLUMN.grad_input
    assert ("layers/{key,query,value} (" in str(report) and "the input gradients of layers/query, layers/key, "
            "layers/value in one reduce-scatter ring" in str(report))

    # the compiled step: key, value and up run no ring of their own; their input gradients join the gathering
    # call's reduce-scatter ring (3 hops each on a ring of 4).  Without sharing XLA still folds the identical
    # first permutes of one x's rings, but not the steps after, each fenced in its own ring
    # (`collective_matmul.ops.ring._Ring.fence`): two more each for key, value and up
    shared, alone = counts(mesh, tuned, params, x), counts(mesh, rings(Tuned(), share=False), params, x)
    assert alone["collective-permute"] - shared["collective-permute"] == 3 * 3 + 3 * 2, (shared, alone)
    baseline = Tuned()
    unshared = Tuned()
    unshared.share = False
    on, off = counts(mesh, baseline, params, x), counts(mesh, unshared, params, x)
    assert off["reduce-scatter"] - on["reduce-scatter"] == 3 and on["all-gather"] == off["all-gather"], (on, off)
    assert not unshared.report().groups and baseline.report().groups == report.groups


def step_counts(llama, tuned, args) -> dict[str, int]:
    text = llama.tiny_llama_step(tuned)[0].lower(*args).compile().as_text()
    return {op: text.count(f" {op}(") for op in COLLECTIVES}


@pytest.mark.slow  # the example's five compiles and a step (20 s); the layer test above checks the same counts
def test_the_llama_example_moves_each_normed_activation_once():
    """examples/flax_linen_llama.py on 8 devices (data=2, model=4), against the step as written: at the baseline
    the drop-in runs the collectives it runs (its all-gathers, and one reduce-scatter per group: the CPU backend
    writes the step as written's as all-reduces); every call on rings, sharing takes the rings of key, value and
    up out of the backward; the step trains as the step as written does."""
    llama = importlib.import_module("examples.flax_linen_llama")
    reference, args, _ = llama.tiny_llama_step(None)
    as_written = step_counts(llama, None, args)
    at_baseline = {share: step_counts(llama, rings(Tuned(), share=share).variant(
        "baseline", lambda role, configs: OpConfigs()), args) for share in (True, False)}
    scattered = {share: c["reduce-scatter"] + c["all-reduce"] for share, c in at_baseline.items()}
    assert at_baseline[True]["all-gather"] == as_written["all-gather"] == at_baseline[False]["all-gather"]
    assert scattered[True] == as_written["all-reduce"] + as_written["reduce-scatter"], (at_baseline, as_written)
    assert scattered[False] - scattered[True] == 3  # key, value, up: each scattered its own without sharing
    want = reference(*args)
    steps = {share: llama.tiny_llama_step(rings(Tuned(), share=share))[0] for share in (True, False)}
    texts = {share: step.lower(*args).compile().as_text() for share, step in steps.items()}
    permutes = {share: text.count("collective-permute(") for share, text in texts.items()}
    assert permutes[False] - permutes[True] == 3 * 3 + 3 * 2, permutes  # as in the layer test: fenced steps
    got = steps[True](*args)
    errors = jax.tree.leaves(jax.tree.map(rel_error, got[:2], want[:2]))  # parameters and optimizer state
    assert max(errors) <= 1e-5 and abs(float(got[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))


def test_discovery_lists_the_projections_of_one_gather_as_a_group():
    """The step as written gathers each normed activation once for its projections: discovery says which roles
    read one gather (what `cmtune problems --step` prints as ``Llama/layers/{key,query,value}``)."""
    from collective_matmul.programs.discovery import discover

    llama = importlib.import_module("examples.flax_linen_llama")
    step, args, mesh = llama.tiny_llama_step(None)
    found = discover(step, args, mesh)
    groups = sorted(sorted(group) for group in found.groups)
    assert groups == [["Llama/layers/gate", "Llama/layers/up"],
                      ["Llama/layers/key", "Llama/layers/query", "Llama/layers/value"]]
    assert {p.role for p in found.problems} >= {"Llama/layers/key", "Llama/layers/up"}  # each still listed
    summed = {p.role: p.problem.key for p in found.problems if "{" in p.role}  # and each group's input gradient
    assert summed == {"Llama/layers/{key,query,value}": "matmul_reduce_scatter:128x192x64:float32:4",
                      "Llama/layers/{gate,up}": "matmul_reduce_scatter:128x256x64:float32:4"}
    assert all(p.slot == "grad_input" and p.count == 2 for p in found.problems if "{" in p.role)
    assert group_label(groups[1]) == "Llama/layers/{key,query,value}"
    assert group_label(["a/q", "b/k"]) == "a/q, b/k"


def test_a_groups_summed_input_gradient_is_looked_up_as_its_own_problem(tmp_path):
    """A bundle that tunes only the groups' summed problems (the rest at the baseline): the drop-in finds them
    exactly, the tiny Llama's compiled step runs those two rings and no other, and without sharing none."""
    from collective_matmul import Bundle, Problem
    from collective_matmul.planning.models import ring_hardware
    from collective_matmul.wire.bundle import TunedConfig

    llama = importlib.import_module("examples.flax_linen_llama")
    _, args, mesh = llama.tiny_llama_step(None)
    ring = ring_hardware(mesh, "model")
    rs = lambda n, k: Problem(collective="matmul_reduce_scatter", m=128, k=k, n=n, dtype="float32",  # noqa: E731
                              axis_size=4)
    entries = {rs(64, 64): D("baseline"), rs(64, 128): D("baseline"), rs(64, 192): D("ring-uni-c1-full-in"),
               rs(64, 256): D("ring-bi-c2-full-in")}
    Bundle(configs=[TunedConfig(problem=p, hardware=ring.identity(), decomposition=d, time_s=1.0, baseline_s=1.0,
                                speedup=1.0, software=ring.software)
                    for p, d in entries.items()]).save(tmp_path / "b.json")
    tuned = Tuned(bundle=tmp_path / "b.json")
    assert step_counts(llama, tuned, args)["collective-permute"] == 3 + 2 * 3  # one way, 3 hops; both ways, 2 chunks
    summed = {s.role: s.runs["grad_input"] for s in tuned.report() if s.members}
    assert {role: (f.decomposition.id, f.match) for role, f in summed.items()} == {
        "layers/{key,query,value}": ("ring-uni-c1-full-in", "exact"),
        "layers/{gate,up}": ("ring-bi-c2-full-in", "exact")}
    unshared = Tuned(bundle=tmp_path / "b.json")
    unshared.share = False
    assert step_counts(llama, unshared, args)["collective-permute"] == 0
    assert not any(s.members for s in unshared.report())


def test_a_step_without_a_shared_activation_compiles_to_the_same_program():
    """The NNX GPT example (one fused qkv projection, one up projection): nothing reuses a gather, and the
    gathered copy each column call hands back (with the zero cotangent it adds) leaves no op in the program."""
    import collections
    import re

    gpt = importlib.import_module("examples.flax_nnx_gpt")
    programs = {}
    for share in (True, False):
        tuned = Tuned()
        tuned.share = share
        step, args, _ = gpt.tiny_gpt_step(tuned)
        programs[share] = collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", step.lower(*args).compile().as_text()))
        assert not tuned.report().groups and tuned.report().applied
    assert programs[True] == programs[False] and programs[True]["all-gather"] > 0


def test_a_cast_or_another_ring_of_the_same_activation_gathers_for_itself():
    """Plain calls of the drop-in: two projections of ``h`` share; one of ``h`` cast to bfloat16 (another value)
    and one over the data axis (another ring) each gather for themselves, and every value is right."""
    mesh = mesh_2d()
    rng = np.random.default_rng(2)
    h = jax.device_put(jnp.asarray(rng.standard_normal((BATCH, SEQ, D_MODEL)), jnp.float32),
                       NamedSharding(mesh, P("data", "model", None)))
    ws = [jnp.asarray(rng.standard_normal((D_MODEL, 16)), jnp.float32) for _ in range(4)]
    tuned = Tuned()  # every call at the baseline: a ring of 2 (the data axis) takes no bidirectional ring
    numbers = (((2,), (0,)), ((), ()))
    model_ring = cm_flax.dot_general(tuned, mesh=mesh, kind="column", role="a")
    second = cm_flax.dot_general(tuned, mesh=mesh, kind="column", role="b")
    cast = cm_flax.dot_general(tuned, mesh=mesh, kind="column", role="cast")
    data_ring = cm_flax.dot_general(tuned, mesh=mesh, axis="data", kind="column", role="data", batch_axis=None)

    def step(h, ws):
        return (model_ring(h, ws[0], numbers), second(h, ws[1], numbers),
                cast(h.astype(jnp.bfloat16), ws[2].astype(jnp.bfloat16), numbers), data_ring(h, ws[3], numbers))

    outs = jax.jit(step)(h, ws)
    want = [np.einsum("bmk,kn->bmn", np.asarray(h, np.float64), np.asarray(w, np.float64)) for w in ws]
    for out, expected, tolerance in zip(outs, want, (1e-5, 1e-5, 2e-2, 1e-5), strict=True):
        assert rel_error(out, expected) <= tolerance
    report = tuned.report()
    assert report.groups == {"a": ["b"]}
    assert {s.role: s.gathered_by for s in report} == {"a": "", "b": "a", "cast": "", "data": ""}
