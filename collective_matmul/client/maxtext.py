"""MaxText's own train step as a cmtune step spec (MaxText 0.2.5, Python 3.12: ``pip install "maxtext[tpu]==0.2.5"``).

`step_spec` builds the step MaxText's ``train_compile`` builds, from MaxText's own config arguments::

    from collective_matmul.client import maxtext as cm_maxtext

    ARGV = ["model_name=default", "ici_tensor_sequence_parallelism=8", "scan_layers=false"]

    def maxtext_step(tuned=None, devices=None):
        return cm_maxtext.step_spec(ARGV, tuned=tuned, devices=devices)

and returns ``(step, args, mesh, context)``: MaxText's own initialised state and a synthetic batch, or abstract
arguments (for a TPU topology's devices, or ``abstract=True``: discovery and compiles of a model too large to
initialise here), and the context MaxText lowers its step under (``jax.set_mesh(mesh)`` and its logical axis
rules, without which every activation constraint is silently replicated), which cmtune enters for every
lowering and run.

Given a config source (``tuned``), every ``DenseGeneral`` of the model runs its product through cmtune's drop-in
on the mesh's tensor-parallel axis, each layer's kernel axes telling column from row projections, and on its FSDP
axis (MaxText's default sharding) a kernel sharded over it as a weight gathered on a ring (`dense_layers`):
MaxText is not forked, and its step is otherwise the one it runs.  Roles are MaxText's module paths
(``decoder/layers_0/mlp/wi_0``): its NNX layers push no name scope, so the context names each call after its
path in the model's graph.  MaxText is imported only when a function here is called.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Sequence

# What a spec on a host without GCS or tokenizers needs, before the user's arguments.
OFFLINE = ("run_name=cmtune", "enable_checkpointing=false", "dataset_type=synthetic", "enable_tensorboard=false",
           "gcs_metrics=false", "enable_goodput_recording=false", "monitor_goodput=false", "jax_cache_dir=",
           "skip_jax_distributed_system=true")  # cmtune sets the cluster up itself (`cmtune.workers.cluster`)
# MaxText's tensor-parallel mesh axes: the drop-in's ring is the one of them larger than 1.
TENSOR_AXES = ("tensor", "tensor_sequence", "tensor_transpose")
# MaxText's FSDP axis (``ici_fsdp_parallelism``, -1 by default): a weight sharded over it is gathered on a ring of it.
FSDP_AXIS = "fsdp"


def config(argv: Sequence[str], *, devices: Sequence | None = None, base_output_directory: str | None = None):
    """MaxText's config for ``argv`` (``key=value`` overrides of its ``base.yml``), with `OFFLINE` first.

    ``devices`` (default ``jax.devices()``) are the devices the step is built for: on CPU devices MaxText runs
    as ``hardware=cpu``; for devices compiled for ahead of time (a TPU topology) it counts them as its
    ``train_compile`` does (``internal_compile``), not by ``jax.devices()``.
    """
    import jax
    from maxtext.configs import pyconfig

    from collective_matmul.programs.topology import compile_only

    devices = list(devices) if devices is not None else jax.devices()
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    out = base_output_directory or os.path.join(os.environ.get("TMPDIR", "/tmp"), "cmtune-maxtext")
    if compile_only(devices):
        target = (f"hardware={devices[0].platform}", "internal_compile=true",
                  f"internal_compile_num_devices={len(devices)}")
    else:
        target = ("hardware=cpu",) if devices[0].platform == "cpu" else ()
    return pyconfig.initialize(["", base, *OFFLINE, *target, f"base_output_directory={out}", *argv])


def step_spec(argv: Sequence[str], *, tuned=None, devices: Sequence | None = None, abstract: bool | None = None):
    """``(step, args, mesh, context)`` of MaxText's train step for ``argv`` (see the module docstring).

    Args:
        argv: MaxText config overrides, e.g. ``["model_name=default", "ici_tensor_parallelism=8"]``.
        tuned: the spec's ``tuned`` argument: None for the step as written, else a config source (a
            `collective_matmul.Tuned` client, or a variant ``cmtune verify`` builds) whose configs every
            ``DenseGeneral`` runs with (`dense_layers`).
        devices: the spec's ``devices`` argument (None: ``jax.devices()``), e.g. a TPU topology's devices.
        abstract: abstract arguments (discovery, compiles) or MaxText's initialised state and a synthetic batch
            (verify, runs).  Default: abstract only for devices that cannot run here (a TPU topology); give
            True for a model too large to initialise on this host.

    Raises:
        ValueError: for a ``tuned`` source on a mesh with two tensor-parallel axes larger than 1 (`tensor_axis`).
    """
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    from collective_matmul.programs.topology import compile_only

    devices = list(devices) if devices is not None else jax.devices()
    abstract = compile_only(devices) if abstract is None else abstract
    cfg = config(argv, devices=devices)
    mesh = maxtext_utils.get_mesh_from_config(cfg, devices)
    shaped, _, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, cfg)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(cfg, state_shardings, params_shardings)
    func, in_shard, out_shard, static_argnums, donate_argnums = maxtext_utils.get_functional_train_with_signature(
        train.train_step, sharding.get_input_data_sharding(cfg, mesh), input_shardings, model, cfg,
        params_shardings)
    step = jax.jit(func, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static_argnums,
                   donate_argnums=donate_argnums)
    ring = tensor_axis(mesh) if tuned is not None else None  # the step as written needs no ring
    names = tensor_names(cfg.logical_axis_rules, ring) if ring else ()
    fsdp = FSDP_AXIS if tuned is not None and mesh.shape.get(FSDP_AXIS, 1) > 1 else None
    fsdp_names = tensor_names(cfg.logical_axis_rules, fsdp) if fsdp else ()

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(logical_axis_rules(cfg.logical_axis_rules))
        stack.enter_context(dense_layers(tuned, mesh=mesh, axis=ring, tensor_names=names, fsdp_axis=fsdp,
                                         fsdp_names=fsdp_names))
        return stack

    if abstract:
        return step, tuple(shaped), mesh, context
    abstract_state, shaped_batch = shaped
    init = _initial_state(cfg, mesh)
    with logical_axis_rules(cfg.logical_axis_rules):
        state = jax.jit(lambda: nnx.state(init()), out_shardings=jax.tree.map(lambda s: s.sharding,
                                                                             abstract_state))()
    return step, (state, train.make_synthetic_batch(cfg, shaped_batch, seed=0)), mesh, context


def tensor_axis(mesh) -> str | None:
    """The mesh's tensor-parallel axis (one of `TENSOR_AXES` larger than 1): the ring the drop-in decomposes.

    Raises:
        ValueError: if more than one is larger than 1 (the drop-in decomposes one ring per product).
    """
    axes = [a for a in TENSOR_AXES if mesh.shape.get(a, 1) > 1]
    if len(axes) > 1:
        raise ValueError(f"MaxText's mesh shards tensors over {axes} ({dict(mesh.shape)}): cmtune's drop-in "
                         "decomposes one tensor-parallel ring; keep one of the ici_tensor*_parallelism above 1")
    return axes[0] if axes else None


def tensor_names(rules, axis: str) -> tuple[str, ...]:
    """The logical names MaxText's ``logical_axis_rules`` may shard over ``axis``: for a tensor axis (``mlp``,
    ``heads``, ...) a kernel with one among its input axes is a row projection, among its output axes a column one;
    for `FSDP_AXIS` (``embed``, ...) a kernel with one is gathered on that dimension's ring."""
    names = []
    for name, axes in rules:
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if axis in axes and name not in names:
            names.append(name)
    return tuple(names)


@contextlib.contextmanager
def dense_layers(source=None, *, mesh=None, axis: str | None = None, tensor_names: Sequence[str] = (),
                 fsdp_axis: str | None = None, fsdp_names: Sequence[str] = ()):
    """Inside, every MaxText ``linears.DenseGeneral`` call runs under a name scope of its module path
    (``decoder/layers_0/self_attention/query``, which discovery reads as its role) and, given a config ``source``,
    its product through cmtune's drop-in (`collective_matmul.client.flax.DotGeneral`, the layer's own ``kernel_axes``
    telling column from row over the tensor ``axis``, or, with ``fsdp_axis``, a kernel sharded over it on one of
    ``fsdp_names`` gathered on its ring: FSDP's weight rings, under tensor parallelism too).

    The hook is MaxText 0.2.5's: ``DenseGeneral.__call__`` (the layer and its kernel axes) and the module function
    ``linears._compute_dot_general_nnx`` it calls for the product (replaced while inside; a quantized product,
    or one in a layer not reached through ``DenseGeneral``, runs MaxText's own and is reported).  The path is set
    on each layer when ``models.Transformer`` is called (a static attribute: it travels in the graph definition
    through the split and merge MaxText does per remat'd layer).  Enter it before the step's first trace: JAX
    caches traces, and the context is not part of their key.

    Raises:
        RuntimeError: if this MaxText has moved a hook (a version cmtune does not know).
    """
    import jax
    from flax import nnx

    from collective_matmul.client.flax import DotGeneral

    linears, models = _hooks()
    transformer_call, dense_call = models.Transformer.__call__, linears.DenseGeneral.__call__
    compute = linears._compute_dot_general_nnx
    current = contextvars.ContextVar("cmtune_dense_layer", default=None)

    def named(self, *args, **kwargs):
        for path, module in nnx.iter_graph(self):
            if isinstance(module, linears.DenseGeneral):
                object.__setattr__(module, "_cmtune_role", "/".join(map(str, path)))
        return transformer_call(self, *args, **kwargs)

    def scoped(self, *args, **kwargs):
        role = getattr(self, "_cmtune_role", None)
        if role is None:
            return dense_call(self, *args, **kwargs)
        token = current.set(self)
        try:
            with jax.named_scope(role):
                return dense_call(self, *args, **kwargs)
        finally:
            current.reset(token)

    def product(inputs, kernel, axes, contract_ind, matmul_precision, quant_dot_general, initializing,
                out_sharding=None, kernel_scale=None, **kwargs):
        layer = current.get()
        if layer is not None:
            if quant_dot_general is not None or kernel_scale is not None or inputs.dtype != kernel.dtype:
                why = "a quantized product (MaxText's quant): it runs MaxText's own"
            elif axis is None and fsdp_axis is None:
                why = (f"no tensor-parallel or FSDP axis of size > 1 in the mesh {dict(mesh.shape)} "
                       f"({', '.join((*TENSOR_AXES, FSDP_AXIS))})")
            else:
                drop_in = DotGeneral(source, mesh=mesh, axis=axis, kernel_axes=layer.kernel_axes,
                                     tensor_names=tensor_names, fsdp_axis=fsdp_axis, fsdp_names=fsdp_names,
                                     role=layer._cmtune_role)
                kept = {"out_sharding": out_sharding} if out_sharding is not None else {}
                return drop_in(inputs, kernel, ((tuple(axes), tuple(contract_ind)), ((), ())),
                               precision=jax.lax.Precision(matmul_precision), **kept)
            source.fell_back(layer._cmtune_role, why)
        return compute(inputs, kernel, axes, contract_ind, matmul_precision, quant_dot_general, initializing,
                       out_sharding, kernel_scale=kernel_scale, **kwargs)

    models.Transformer.__call__, linears.DenseGeneral.__call__ = named, scoped
    if source is not None:
        linears._compute_dot_general_nnx = product
    try:
        yield
    finally:
        models.Transformer.__call__, linears.DenseGeneral.__call__ = transformer_call, dense_call
        linears._compute_dot_general_nnx = compute


def _hooks():
    """MaxText's ``linears`` and ``models`` modules, checked for what `dense_layers` replaces."""
    from maxtext.layers import linears
    from maxtext.models import models

    missing = [name for name, there in (("maxtext.models.models.Transformer", hasattr(models, "Transformer")),
                                        ("maxtext.layers.linears.DenseGeneral", hasattr(linears, "DenseGeneral")),
                                        ("maxtext.layers.linears._compute_dot_general_nnx",
                                         hasattr(linears, "_compute_dot_general_nnx"))) if not there]
    if missing:
        raise RuntimeError(f"this MaxText has no {', '.join(missing)}: cmtune's hooks are MaxText 0.2.5's "
                           "(pip install 'maxtext[tpu]==0.2.5')")
    return linears, models


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
