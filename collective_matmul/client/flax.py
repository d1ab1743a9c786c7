"""The Flax drop-in: a ``dot_general`` that runs the tuned collective matmuls inside Flax layers.

Flax's dense layers take their matmul as an argument: linen ``Dense`` / ``DenseGeneral``
(``dot_general=`` or ``dot_general_cls=``) and NNX ``Linear`` / ``LinearGeneral``
(``dot_general=``, called with keyword arguments such as ``preferred_element_type=`` and
``out_sharding=``).  `dot_general` gives one for a layer, from a `collective_matmul.Tuned`
client (or any of the step variants ``cmtune verify`` builds), the mesh, the tensor axis and
either the kind of projection or MaxText-style logical kernel axes::

    up = nnx.Linear(d, f, dot_general=cm_flax.dot_general(tuned, mesh=mesh, kind="column"), rngs=rngs)
    down = nn.Dense(d, dot_general=cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("mlp", "embed")))

- ``column`` (all-gather → matmul): the input ``[..., M, K...]`` sharded on its rows M over the
  tensor axis, the kernel ``[K..., N...]`` on its output columns; the result sharded on N.
- ``row`` (matmul → reduce-scatter): the input sharded on its contracting features, the kernel
  on its input rows; the result summed over the axis and scattered on M.
- ``fsdp`` (the weight all-gathered before its product, FSDP's): the kernel sharded over the ring
  ``axis`` on its input rows K (``fsdp``) or on its output columns N (``fsdp_out``), the input's
  first dimension sharded over the batch axes (``auto``: the other mesh axes but the tensor axes)
  and the ring; ``tensor_axis`` names a mesh axis
  sharding the kernel's other dimension (FSDP x tensor parallelism).  The weight's shards go round
  the ring (`collective_matmul.weight_allgather_matmul`), its gradient reduce-scattered onto them.
- ``kernel_axes``: with ``fsdp_axis`` (a mesh axis larger than 1), a kernel whose axes hold an FSDP
  logical name (``embed``) is ``fsdp`` over it (``fsdp_out`` if the name is an output axis), with
  ``axis`` as its ``tensor_axis`` where the kernel's other axes hold a tensor-parallel name.
  Otherwise a kernel whose input axes hold a tensor-parallel logical name (``mlp``, ``heads``,
  ``kv_heads``, ``q_heads``, ``vocab``) is ``row``, one whose output axes hold one is ``column``;
  a kernel with neither is not sharded over a ring and runs plain.

Multi-dimensional kernels (``DenseGeneral`` / ``LinearGeneral``, heads × head_dim) are folded
to ``[K, N]`` and the result unfolded.  Each call runs the tuned op with its custom VJP
(forward, ``grad_input`` and ``grad_weight`` configs, and the per-role overrides of
``Tuned(model=...)``); a call that does not fit the layout (batch dimensions in the dimension
numbers, a kernel contracted on other axes, a precision or accumulation type the ops do not
run, shapes that do not divide over the ring) runs ``lax.dot_general`` as given and is reported
with the reason: `Tuned.report` lists every call, applied or not.  The role of a call is its
Flax module path or named scope, else its source location (`collective_matmul.programs.roles`).

Flax itself is not imported here: the drop-in is a plain function of arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding

from collective_matmul.ops.collective import (
    OPS,
    WEIGHT_DIM_OF,
    allgather_matmul_keep,
    batch_axis_of,
    batch_names,
    check_call,
    gathered_matmul,
    is_explicit,
    weight_allgather_matmul,
)
from collective_matmul.ops.share import GATHERS, SharedGather
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Collective
from collective_matmul.programs.roles import call_site, group_label

if TYPE_CHECKING:
    from collective_matmul.client.sources import ConfigSource

__all__ = ["AUTO", "FSDP_NAMES", "KINDS", "TENSOR_NAMES", "DotGeneral", "dot_general", "dot_general_cls"]

KINDS = {"column": Collective.ALLGATHER_MATMUL, "row": Collective.MATMUL_REDUCE_SCATTER,
         "fsdp": Collective.WEIGHT_ALLGATHER_MATMUL_K, "fsdp_out": Collective.WEIGHT_ALLGATHER_MATMUL_N,
         **{str(c): c for c in (Collective.ALLGATHER_MATMUL, Collective.MATMUL_REDUCE_SCATTER,
                                Collective.WEIGHT_ALLGATHER_MATMUL_K, Collective.WEIGHT_ALLGATHER_MATMUL_N)}}
TENSOR_NAMES = ("mlp", "heads", "kv_heads", "q_heads", "vocab")
FSDP_NAMES = ("embed",)
AUTO = "auto"


class _Route(NamedTuple):
    """How one call runs: its collective, the ring's mesh axis, the weight's tensor axis (FSDP x TP)."""

    collective: str
    axis: str
    tensor_axis: str | None = None


class DotGeneral:
    """A ``lax.dot_general`` replacement for one layer (see the module docstring)."""

    def __init__(self, source: ConfigSource, *, mesh: Mesh, axis: str | None = "model", kind: str | None = None,
                 kernel_axes: Sequence[str | None] | None = None, tensor_names: Sequence[str] = TENSOR_NAMES,
                 batch_axis=AUTO, role: str | None = None, tensor_axis: str | None = None,
                 fsdp_axis: str | None = None, fsdp_names: Sequence[str] = FSDP_NAMES):
        for what, name in (("axis", axis), ("tensor_axis", tensor_axis), ("fsdp_axis", fsdp_axis)):
            if name is not None and name not in mesh.shape:
                raise ValueError(f"{what} {name!r} is not an axis of the mesh {dict(mesh.shape)}")
        if (kind is None) == (kernel_axes is None):
            raise ValueError("give the projection's kind ('column', 'row', 'fsdp' or 'fsdp_out') or its kernel_axes "
                             "(one of them)")
        if kind is not None and kind not in KINDS:
            raise ValueError("kind must be 'column' (all-gather -> matmul), 'row' (matmul -> reduce-scatter), 'fsdp' "
                             "or 'fsdp_out' (the weight gathered: sharded on its input rows or output columns), or "
                             f"the collective's name ({', '.join(sorted(set(KINDS.values())))}), got {kind!r}")
        weight = kind is not None and KINDS[kind] in WEIGHT_DIM_OF
        if tensor_axis is not None and not weight:
            raise ValueError("tensor_axis is the weight's other sharded axis under FSDP: give it with kind='fsdp' or "
                             "'fsdp_out' (kernel_axes take axis as the tensor axis of an FSDP kernel)")
        if tensor_axis is not None and tensor_axis == axis:
            raise ValueError(f"tensor_axis {tensor_axis!r} is the ring's axis: give a different mesh axis")
        if axis is None and (kind is not None or fsdp_axis is None):
            raise ValueError("axis=None runs FSDP kernels only: give kernel_axes and the fsdp_axis")
        if kind is not None and fsdp_axis is not None:
            raise ValueError("fsdp_axis decides an FSDP kernel from its kernel_axes: with kind='fsdp' or 'fsdp_out' "
                             "the ring is axis (and tensor_axis the weight's other sharded axis); give one of them")
        if fsdp_axis is not None and fsdp_axis == axis:
            raise ValueError(f"fsdp_axis {fsdp_axis!r} is the tensor-parallel axis too: give two different axes")
        self.source, self.mesh, self.axis = source, mesh, axis
        self.kind = KINDS[kind] if kind is not None else None
        self.kernel_axes = tuple(kernel_axes) if kernel_axes is not None else None
        self.tensor_names, self.fsdp_names = tuple(tensor_names), tuple(fsdp_names)
        self.tensor_axis, self.fsdp_axis = tensor_axis, fsdp_axis
        self.batch_axis, self.role = batch_axis, role

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        label, site = call_site()
        role = self.role or label
        try:
            route, x, w, unfold = self._fit(lhs, rhs, dimension_numbers, precision, preferred_element_type, kwargs)
            batch_axis = self._batch_axis(x, route)
            check_call(route.collective, x, w, mesh=self.mesh, axis=route.axis, batch_axis=batch_axis,
                       tensor_axis=route.tensor_axis)
        except ValueError as exc:  # _Unfit, or shapes that do not divide over the ring
            return self._plain(role, site, str(exc), lhs, rhs, dimension_numbers, precision,
                               preferred_element_type, kwargs)
        y = self._run(role, site, route, lhs, x, w, batch_axis).reshape(unfold)
        out_sharding = kwargs.get("out_sharding")
        if out_sharding is not None:
            y = _reshard(y, out_sharding, self.mesh)
        return y

    def _run(self, role, site, route: _Route, lhs, x, w, batch_axis):
        """The op of one call; a column call of an activation an earlier one gathered reuses its gather."""
        collective = route.collective
        where_to = dict(mesh=self.mesh, axis=route.axis, batch_axis=batch_axis)
        if collective in WEIGHT_DIM_OF:  # FSDP's: the weight's shards go round the ring
            configs = self.source.configs(role, collective, x, w, **where_to, tensor_axis=route.tensor_axis,
                                          site=site, via="dot_general")
            return weight_allgather_matmul(x, w, **where_to, weight_dim=WEIGHT_DIM_OF[collective],
                                           tensor_axis=route.tensor_axis, config=configs.forward,
                                           grad_input=configs.grad_input, grad_weight=configs.grad_weight)
        share = collective == Collective.ALLGATHER_MATMUL and getattr(self.source, "share", False)
        found = GATHERS.find(lhs, **where_to) if share else None
        if found is not None and found[0].shape[1:] == x.shape:  # the same activation, folded alike
            stack, group = found
            group.join(role)
            self.source.configs(role, collective, x, w, **where_to, site=site, via="dot_general",
                                gathered_by=group.first)
            return gathered_matmul(stack, w, **where_to, group=group)
        # a served config that does not fit is skipped inside `configs`; a step variant whose edit does
        # not fit raises (`VariantError`): it must fail, not time lax.dot_general under its name
        configs = self.source.configs(role, collective, x, w, **where_to, site=site, via="dot_general")
        if share and configs.forward.method != "xla":
            group = SharedGather(role)

            def summed(n: int) -> Decomposition:  # at the backward's trace, once every reader has joined
                group_w = jax.ShapeDtypeStruct((w.shape[0], n), w.dtype)
                return self.source.configs(group_label(group.roles), collective, x, group_w, **where_to, site=site,
                                           via="dot_general", members=group.roles).grad_input

            group.grad_input = summed
            y, stack = allgather_matmul_keep(x, w, **where_to, config=configs.forward, grad_input=configs.grad_input,
                                             grad_weight=configs.grad_weight, group=group)
            GATHERS.keep(lhs, stack, **where_to, group=group)
            return y
        return OPS[collective](x, w, **where_to, config=configs.forward, grad_input=configs.grad_input,
                               grad_weight=configs.grad_weight)

    def _fit(self, lhs, rhs, dimension_numbers, precision, preferred, kwargs):
        (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
        lhs_c, rhs_c = tuple(int(d) % lhs.ndim for d in lhs_c), tuple(int(d) % rhs.ndim for d in rhs_c)
        if lhs_b or rhs_b:
            raise _Unfit(f"batch dimensions {tuple(lhs_b)} x {tuple(rhs_b)} (attention-like): not a projection")
        if not lhs_c or lhs_c != tuple(range(lhs.ndim - len(lhs_c), lhs.ndim)):
            raise _Unfit(f"the input contracts dimensions {lhs_c}, not its last {len(lhs_c) or 1}")
        if rhs_c != tuple(range(len(rhs_c))):
            raise _Unfit(f"the kernel contracts dimensions {rhs_c}, not its first {len(rhs_c)} (a transposed kernel)")
        if lhs.ndim - len(lhs_c) < 1 or rhs.ndim == len(rhs_c):
            raise _Unfit(f"no rows or no output columns: input {tuple(lhs.shape)}, kernel {tuple(rhs.shape)}")
        if precision not in (None, lax.Precision.DEFAULT, "default") and precision != (None, None):
            raise _Unfit(f"precision={precision}: the decomposed ops run the default precision")
        if preferred is not None and jax.numpy.dtype(preferred) != lhs.dtype:
            raise _Unfit(f"preferred_element_type={jax.numpy.dtype(preferred).name} on {lhs.dtype} inputs: the "
                         "decomposed ops accumulate as their configs say and return the input dtype")
        if lhs.dtype != rhs.dtype:
            raise _Unfit(f"inputs of {lhs.dtype} and a kernel of {rhs.dtype}")
        unknown = sorted(set(kwargs) - {"out_sharding"})
        if unknown:
            raise _Unfit(f"arguments the ops do not take: {unknown}")
        route = self._route(len(rhs_c), rhs.ndim)
        k = math.prod(lhs.shape[d] for d in lhs_c)
        n = math.prod(rhs.shape[len(rhs_c):])
        x = lhs.reshape(*lhs.shape[: lhs.ndim - len(lhs_c)], k)
        w = rhs.reshape(k, n)
        unfold = (*lhs.shape[: lhs.ndim - len(lhs_c)], *rhs.shape[len(rhs_c):])
        return route, x, w, unfold

    def _route(self, contracted: int, ndim: int) -> _Route:
        """The call's collective and axes: its ``kind``, else what its ``kernel_axes`` say (module docstring)."""
        if self.kind is not None:
            return _Route(self.kind, self.axis, self.tensor_axis)
        axes = self.kernel_axes
        if len(axes) != ndim:
            raise _Unfit(f"kernel_axes {axes} name {len(axes)} axes, the kernel has {ndim}")
        inputs, outputs = axes[:contracted], axes[contracted:]
        tensor_in, tensor_out = (any(a in self.tensor_names for a in side) for side in (inputs, outputs))
        tensor = self.axis is not None and self.mesh.shape[self.axis] > 1
        if self.fsdp_axis is not None and self.mesh.shape[self.fsdp_axis] > 1:
            for sharded, other, collective in ((inputs, tensor_out, Collective.WEIGHT_ALLGATHER_MATMUL_K),
                                               (outputs, tensor_in, Collective.WEIGHT_ALLGATHER_MATMUL_N)):
                if any(a in self.fsdp_names for a in sharded):
                    return _Route(collective, self.fsdp_axis, self.axis if other and tensor else None)
        if self.axis is not None and tensor_in:
            return _Route(Collective.MATMUL_REDUCE_SCATTER, self.axis)
        if self.axis is not None and tensor_out:
            return _Route(Collective.ALLGATHER_MATMUL, self.axis)
        rings = " or ".join(f"{names} over {a!r}" for names, a in ((self.fsdp_names, self.fsdp_axis),
                                                                   (self.tensor_names, self.axis)) if a)
        raise _Unfit(f"kernel_axes {axes} hold no name of {rings}: the kernel is not sharded over a ring")

    def _batch_axis(self, x, route: _Route):
        weight = route.collective in WEIGHT_DIM_OF  # FSDP's rows are sharded over the other axes and the ring
        if self.batch_axis != AUTO:
            if not weight:
                return self.batch_axis
            # the batch axes a tensor route takes (("data", "fsdp")) with the weight's ring and tensor axis left out:
            # the ring follows them on the rows
            return batch_axis_of([a for a in batch_names(self.batch_axis) if a not in (route.axis, route.tensor_axis)])
        if x.ndim < 3 and not weight:
            return None
        # never the ring, nor the tensor axis (an FSDP kernel's other side may hold no tensor name: the activation
        # is still not sharded over it)
        rings = {route.axis, route.tensor_axis, self.axis}
        others = tuple(a for a in self.mesh.axis_names if a not in rings and self.mesh.shape[a] > 1)
        size = math.prod(self.mesh.shape[a] for a in others)
        if not others or x.shape[0] % size:
            return None
        return batch_axis_of(others)

    def _plain(self, role, site, reason, lhs, rhs, dimension_numbers, precision, preferred, kwargs):
        self.source.fell_back(role, reason, site=site)
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred, **kwargs)

    def __repr__(self) -> str:
        what = self.kind or f"kernel_axes={self.kernel_axes}"
        fsdp = f", fsdp_axis={self.fsdp_axis!r}" if self.fsdp_axis else ""
        tensor = f", tensor_axis={self.tensor_axis!r}" if self.tensor_axis else ""
        return f"collective_matmul.client.flax.DotGeneral({what}, axis={self.axis!r}{tensor}{fsdp})"


class _Unfit(ValueError):
    """A call that does not fit the decomposed ops' layout (it runs ``lax.dot_general``)."""


def dot_general(source: ConfigSource | None, *, mesh: Mesh, axis: str | None = "model", kind: str | None = None,
                kernel_axes: Sequence[str | None] | None = None, tensor_names: Sequence[str] = TENSOR_NAMES,
                batch_axis=AUTO, role: str | None = None, tensor_axis: str | None = None,
                fsdp_axis: str | None = None, fsdp_names: Sequence[str] = FSDP_NAMES):
    """A ``dot_general`` for a Flax layer that runs ``source``'s configs; ``lax.dot_general`` if ``source`` is None.

    Args:
        source: a `collective_matmul.client.sources.ConfigSource` (a `collective_matmul.Tuned`, a step variant of
            one, fixed configs), or None for the step as written (then this is ``jax.lax.dot_general`` itself).
        mesh: the device mesh.
        axis: the ring's mesh axis: the tensor-parallel one (``column``, ``row``, ``kernel_axes``), the FSDP one
            (``fsdp``, ``fsdp_out``); None with ``kernel_axes`` and ``fsdp_axis``: no tensor parallelism.
        kind: ``"column"`` (all-gather → matmul), ``"row"`` (matmul → reduce-scatter), ``"fsdp"`` or
            ``"fsdp_out"`` (the weight all-gathered, sharded on its input rows or its output columns).
        kernel_axes: instead of ``kind``, the kernel's logical axes (MaxText style).
        tensor_names: the logical names that ``kernel_axes`` shard over ``axis``.
        batch_axis: the mesh axis (or axes) sharding the input's first dimension (for FSDP, the ring's follows
            them: given with ``fsdp_axis``, the FSDP calls leave their ring and tensor axis out of it);
            ``"auto"``: every other mesh axis but the tensor axes, where the batch divides over them.
        role: the calls' role (default: the Flax module path, named scope or source location).
        tensor_axis: with ``kind="fsdp"``/``"fsdp_out"``, a mesh axis sharding the kernel's other dimension.
        fsdp_axis: with ``kernel_axes``, the mesh axis FSDP shards kernels over (MaxText's ``fsdp``).
        fsdp_names: the logical names that ``kernel_axes`` shard over ``fsdp_axis``.

    Raises:
        ValueError: if an axis is not a mesh axis, neither (or both) of ``kind`` and ``kernel_axes`` are given, or
            the axes given do not go together.
    """
    if source is None:
        return lax.dot_general
    return DotGeneral(source, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, tensor_names=tensor_names,
                      batch_axis=batch_axis, role=role, tensor_axis=tensor_axis, fsdp_axis=fsdp_axis,
                      fsdp_names=fsdp_names)


def dot_general_cls(source: ConfigSource | None, **options):
    """For linen's ``dot_general_cls=``: a class-like factory Flax calls with no arguments (`dot_general` options)."""
    made = dot_general(source, **options)
    return lambda: made


def _reshard(y, sharding, mesh: Mesh):
    if not isinstance(sharding, NamedSharding):
        sharding = NamedSharding(mesh, sharding)
    if is_explicit(mesh):
        return jax.sharding.reshard(y, sharding)
    return lax.with_sharding_constraint(y, sharding)
