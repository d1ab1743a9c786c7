"""The example training step with `Tuned` equals the baseline's loss and gradients."""

from __future__ import annotations

import warnings
from functools import partial

import jax
import numpy as np
import pytest

from cmtune.launcher import running_server
from collective_matmul import Bundle, Decomposition, Hardware, Problem, Tuned, allgather_matmul, matmul_reduce_scatter
from collective_matmul.client.tuned import ring_hardware
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.lookup import NOT_MEASURED
from examples.mlp_block import init, train_step


class Baseline:
    @staticmethod
    def allgather_matmul(x, w, role=None, **kw):
        return allgather_matmul(x, w, config=Decomposition.baseline(), **kw)

    @staticmethod
    def matmul_reduce_scatter(x, w, role=None, **kw):
        return matmul_reduce_scatter(x, w, config=Decomposition.baseline(), **kw)


UP = Decomposition(direction="bidirectional", chunks=4, unroll="full", accumulate="concat")
DOWN = Decomposition(direction="unidirectional", chunks=2, unroll=1, accumulate="input_dtype")
GRAD_WEIGHT = Decomposition(direction="bidirectional", chunks=2, unroll="full", accumulate="input_dtype")


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), ("model",))


@pytest.fixture
def bundle_path(tmp_path, mesh):
    ring = ring_hardware(mesh, "model")
    hw, here = ring.identity(), ring.software  # measured on this process's software stack: exact here
    up = Problem(collective="allgather_matmul", m=128, k=64, n=256, dtype="float32", axis_size=8)
    down = Problem(collective="matmul_reduce_scatter", m=128, k=256, n=64, dtype="float32", axis_size=8)
    # the weight gradient of both (up: dW, k=K, n=N; down: dWᵀ, k=N, n=K) is one problem
    grad_weight = Problem(collective="allgather_grad_weight", m=128, k=64, n=256, dtype="float32", axis_size=8)
    bundle = Bundle(configs=[
        TunedConfig(problem=up, hardware=hw, decomposition=UP, time_s=1e-3, baseline_s=2e-3, speedup=2.0,
                    software=here),
        TunedConfig(problem=down, hardware=hw, decomposition=DOWN, time_s=1e-3, baseline_s=1.5e-3, speedup=1.5,
                    software=here),
        TunedConfig(problem=grad_weight, hardware=hw, decomposition=GRAD_WEIGHT, time_s=1e-3, baseline_s=1.1e-3,
                    speedup=1.1, software=here),
    ])
    path = tmp_path / "bundle.json"
    bundle.save(path)
    return path


def compare_with_baseline(tuned, mesh):
    params, x, target = init(jax.random.key(0), mesh=mesh)
    _, loss, grads = jax.jit(partial(train_step, ops=tuned, mesh=mesh))(params, x, target)
    _, want_loss, want_grads = jax.jit(partial(train_step, ops=Baseline, mesh=mesh))(params, x, target)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for name in ("w_up", "w_down"):
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=1e-4, atol=1e-6)


def test_training_step_with_a_bundle_equals_the_baseline(mesh, bundle_path):
    tuned = Tuned(bundle=bundle_path)
    compare_with_baseline(tuned, mesh)
    found = {problem.collective: lookup for problem, lookup in tuned.resolved}
    assert found["allgather_matmul"].decomposition == UP and found["allgather_matmul"].match == "exact"
    assert found["matmul_reduce_scatter"].decomposition == DOWN and found["matmul_reduce_scatter"].origin == "bundle"
    # each op's backward ran its tuned configs too: the dual problems and the weight gradient
    roles = tuned.resolved_by_role
    assert roles["mlp_up"]["grad_input"][1].decomposition == DOWN
    assert roles["mlp_down"]["grad_input"][1].decomposition == UP
    assert {roles[r]["grad_weight"][1].decomposition for r in ("mlp_up", "mlp_down")} == {GRAD_WEIGHT}


def test_server_down_warns_once_and_falls_back(mesh, bundle_path):
    tuned = Tuned("http://127.0.0.1:9", bundle=bundle_path, timeout_s=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare_with_baseline(tuned, mesh)
    assert sum("unavailable" in str(w.message) for w in caught) == 1
    assert {lookup.origin for _, lookup in tuned.resolved} == {"bundle"}
    no_bundle = Tuned("http://127.0.0.1:9", timeout_s=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_baseline(no_bundle, mesh)
    assert {(lookup.match, lookup.note.split(":")[0]) for _, lookup in no_bundle.resolved} == {
        ("baseline", NOT_MEASURED)}  # nothing measured on this hardware: no ring no one timed


def test_lookups_against_a_real_server_are_cached(mesh, bundle_path, tmp_path):
    from cmtune.service.db import Database
    from cmtune.service.store import SqlStore
    from tests.service.conftest import create_tokens

    url = f"sqlite:///{tmp_path / 'client.sqlite'}"
    reader = create_tokens(url, ["reader"])["reader"]
    db = Database(url)
    with SqlStore(db).write() as tx:
        for config in Bundle.load(bundle_path).configs:
            tx.save_tuned(config, study_id=None)
    db.dispose()
    with running_server(database_url=url) as server:
        tuned = Tuned(server.url, token=reader)
        compare_with_baseline(tuned, mesh)
        found = {problem.collective: lookup for problem, lookup in tuned.resolved}
        hw = ring_hardware(mesh, "model")
        assert found["allgather_matmul"] == found["allgather_matmul"].__class__(UP, "exact", "server", 2.0,
                                                                                hw.software)
        problem = tuned.resolved[0][0]
        server.process.terminate()  # cached: no request needed any more
        server.process.wait()
        assert tuned.lookup(problem, hw).origin == "server"


def test_nothing_measured_on_the_hardware_answers_the_baseline_through_a_real_server(tmp_path):
    """A server holding a config of another hardware only: `Tuned` against it, and its REST look-up, answer the
    baseline and say why on every platform; the cost model's choice only where asked for."""
    from cmtune.service.db import Database
    from cmtune.service.store import SqlStore
    from collective_matmul.client.rest import ApiClient
    from collective_matmul.planning.costmodel import model_choice
    from tests.collective_matmul.test_lookup import BIG, MEASURED_ON, PLATFORMS, RING
    from tests.service.conftest import create_tokens

    url = f"sqlite:///{tmp_path / 'unmeasured.sqlite'}"
    reader = create_tokens(url, ["reader"])["reader"]
    db = Database(url)
    with SqlStore(db).write() as tx:
        tx.save_tuned(TunedConfig(problem=BIG, hardware=MEASURED_ON, decomposition=RING, time_s=1e-3,
                                  baseline_s=2e-3, speedup=2.0), study_id=None)
    db.dispose()
    with running_server(database_url=url) as server, ApiClient(server.url, reader) as api:
        tuned, asked = Tuned(server.url, token=reader), Tuned(server.url, token=reader, unmeasured="costmodel")
        for hardware in PLATFORMS:
            # on TPU and GPU, where XLA decomposes it itself, the unmeasured baseline is the product as written
            as_written = Decomposition.baseline() if hardware.platform == "cpu" else Decomposition.xla()
            found = tuned.lookup(BIG, hardware)
            assert (found.decomposition, found.match) == (as_written, "baseline")
            assert found.origin == "baseline" and found.note.startswith(NOT_MEASURED)
            served = api.config(BIG, hardware)
            assert (served.decomposition, served.match) == (as_written, "baseline")
            assert served.reason.startswith(NOT_MEASURED)
            model = asked.lookup(BIG, hardware)
            assert (model.decomposition, model.match) == (model_choice(BIG, hardware), "model")
            assert api.config(BIG, hardware, unmeasured="costmodel").decomposition == model.decomposition
        measured = tuned.lookup(BIG, MEASURED_ON)
        assert (measured.decomposition, measured.origin) == (RING, "server")  # what was measured still answers


def test_ring_hardware_of_a_2d_mesh():
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    hw = ring_hardware(mesh, "model")
    assert isinstance(hw, Hardware) and hw.device_count == 4 and hw.process_count == 1
