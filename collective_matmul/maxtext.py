"""MaxText's own train step as a cmtune step spec (MaxText 0.2.5, Python 3.12: ``pip install "maxtext[tpu]==0.2.5"``).

`step_spec` builds the step MaxText's ``train_compile`` builds, from MaxText's own config arguments::

    from collective_matmul import maxtext as cm_maxtext

    ARGV = ["model_name=default", "ici_tensor_sequence_parallelism=8", "scan_layers=false"]

    def maxtext_step(tuned=None, devices=None):
        return cm_maxtext.step_spec(ARGV, tuned=tuned, devices=devices)

and returns ``(step, args, mesh, context)``: abstract arguments (``abstract=True``, for ``cmtune problems``
and compile-only runs) or MaxText's own initialised state and a synthetic batch (``abstract=False``), and
the context MaxText lowers its step under (``jax.set_mesh(mesh)`` and its logical axis rules, without which
every activation constraint is silently replicated), which cmtune enters for every lowering and run.

Roles are MaxText's module paths (``decoder/layers_0/mlp/wi_0``): MaxText 0.2.5's NNX layers push no name
scope, so the context names each ``linears.DenseGeneral`` call after its path in the model's graph
(`label_dense_layers`).  MaxText is imported only when a function here is called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

# What a spec on a host without GCS, tokenizers or a coordinator needs, before the user's arguments.
OFFLINE = ("run_name=cmtune", "enable_checkpointing=false", "dataset_type=synthetic", "enable_tensorboard=false",
           "gcs_metrics=false", "enable_goodput_recording=false", "monitor_goodput=false", "jax_cache_dir=")
CPU = ("hardware=cpu", "skip_jax_distributed_system=true")


def config(argv: Sequence[str], *, base_output_directory: str | None = None):
    """MaxText's config for ``argv`` (``key=value`` overrides of its ``base.yml``), with `OFFLINE` first."""
    import jax
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    out = base_output_directory or os.path.join(os.environ.get("TMPDIR", "/tmp"), "cmtune-maxtext")
    cpu = CPU if jax.devices()[0].platform == "cpu" else ()
    return pyconfig.initialize(["", base, *OFFLINE, *cpu, f"base_output_directory={out}", *argv])


def step_spec(argv: Sequence[str], *, tuned=None, devices=None, abstract: bool = True):
    """``(step, args, mesh, context)`` of MaxText's train step for ``argv`` (see the module docstring).

    Args:
        argv: MaxText config overrides, e.g. ``["model_name=default", "ici_tensor_parallelism=8"]``.
        tuned: the spec's ``tuned`` argument (None: the step as written).
        devices: the devices cmtune set up (unused: MaxText builds its mesh from ``jax.devices()``).
        abstract: abstract arguments (discovery, compiles) or MaxText's initialised state and a batch (verify).

    Raises:
        NotImplementedError: for a ``tuned`` client: routing MaxText's dense layers through the drop-in is
            not built yet (discovery and compiles of the step as written are).
    """
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    if tuned is not None:
        raise NotImplementedError("MaxText's dense layers through cmtune's drop-in are not built yet: "
                                  "discover and compile the step as written (tuned=None)")
    del devices
    cfg = config(argv)
    mesh = maxtext_utils.get_mesh_from_config(cfg)
    shaped, _, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, cfg)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(cfg, state_shardings, params_shardings)
    func, in_shard, out_shard, static_argnums, donate_argnums = maxtext_utils.get_functional_train_with_signature(
        train.train_step, sharding.get_input_data_sharding(cfg, mesh), input_shardings, model, cfg,
        params_shardings)
    step = jax.jit(func, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static_argnums,
                   donate_argnums=donate_argnums)

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(logical_axis_rules(cfg.logical_axis_rules))
        stack.enter_context(label_dense_layers())
        return stack

    if abstract:
        return step, tuple(shaped), mesh, context
    abstract_state, shaped_batch = shaped
    init = _initial_state(cfg, mesh)
    with logical_axis_rules(cfg.logical_axis_rules):
        state = jax.jit(lambda: nnx.state(init()), out_shardings=jax.tree.map(lambda s: s.sharding,
                                                                             abstract_state))()
    return step, (state, train.make_synthetic_batch(cfg, shaped_batch, seed=0)), mesh, context


@contextlib.contextmanager
def label_dense_layers():
    """Inside, every MaxText ``linears.DenseGeneral`` call runs under a name scope of its module path
    (``decoder/layers_0/self_attention/query``), which discovery reads as its role.

    The path is set on each layer when ``models.Transformer`` is called (a static attribute: it travels in the
    graph definition through the split and merge MaxText does per remat'd layer).  Enter it before the step's
    first trace: JAX caches traces, and the context is not part of their key.
    """
    import jax
    from flax import nnx
    from maxtext.layers import linears
    from maxtext.models import models

    transformer_call, dense_call = models.Transformer.__call__, linears.DenseGeneral.__call__

    def named(self, *args, **kwargs):
        for path, module in nnx.iter_graph(self):
            if isinstance(module, linears.DenseGeneral):
                object.__setattr__(module, "_cmtune_role", "/".join(map(str, path)))
        return transformer_call(self, *args, **kwargs)

    def scoped(self, *args, **kwargs):
        role = getattr(self, "_cmtune_role", None)
        if role is None:
            return dense_call(self, *args, **kwargs)
        with jax.named_scope(role):
            return dense_call(self, *args, **kwargs)

    models.Transformer.__call__, linears.DenseGeneral.__call__ = named, scoped
    try:
        yield
    finally:
        models.Transformer.__call__, linears.DenseGeneral.__call__ = transformer_call, dense_call


def _initial_state(cfg, mesh):
    """MaxText's fresh train state (model and optimizer), as its ``setup_initial_state`` creates it."""
    from flax import nnx
    from maxtext.common import train_state_nnx
    from maxtext.optimizers import optimizers
    from maxtext.utils import maxtext_utils, model_creation_utils

    create_model, model = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
    tx = optimizers.get_optimizer(cfg, maxtext_utils.create_learning_rate_schedule(cfg), model, mesh=mesh)

    def init():
        m = create_model()
        return train_state_nnx.TrainStateNNX(m, nnx.Optimizer(m, tx, wrt=nnx.Param))

    return init
