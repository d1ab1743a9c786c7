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
- ``kernel_axes``: a kernel whose input axes hold a tensor-parallel logical name (``mlp``,
  ``heads``, ``kv_heads``, ``q_heads``, ``vocab``) is ``row``, one whose output axes hold one
  is ``column``; a kernel with none is not sharded over the tensor axis and runs plain.

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
from typing import TYPE_CHECKING

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding

from collective_matmul.ops.collective import OPS, allgather_matmul_keep, check_call, gathered_matmul, is_explicit
from collective_matmul.ops.share import GATHERS, Group
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.programs.roles import call_site, group_label

if TYPE_CHECKING:
    from collective_matmul.client.sources import ConfigSource

__all__ = ["AUTO", "KINDS", "TENSOR_NAMES", "DotGeneral", "dot_general", "dot_general_cls"]

KINDS = {"column": "allgather_matmul", "row": "matmul_reduce_scatter",
         "allgather_matmul": "allgather_matmul", "matmul_reduce_scatter": "matmul_reduce_scatter"}
TENSOR_NAMES = ("mlp", "heads", "kv_heads", "q_heads", "vocab")
AUTO = "auto"


class DotGeneral:
    """A ``lax.dot_general`` replacement for one layer (see the module docstring)."""

    def __init__(self, source: ConfigSource, *, mesh: Mesh, axis: str = "model", kind: str | None = None,
                 kernel_axes: Sequence[str | None] | None = None, tensor_names: Sequence[str] = TENSOR_NAMES,
                 batch_axis=AUTO, role: str | None = None):
        if axis not in mesh.shape:
            raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        if (kind is None) == (kernel_axes is None):
            raise ValueError("give the projection's kind ('column' or 'row') or its kernel_axes (one of them)")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be 'column' (all-gather -> matmul) or 'row' (matmul -> reduce-scatter), "
                             f"or the collective's name (allgather_matmul, matmul_reduce_scatter), got {kind!r}")
        self.source, self.mesh, self.axis = source, mesh, axis
        self.kind = KINDS[kind] if kind is not None else None
        self.kernel_axes = tuple(kernel_axes) if kernel_axes is not None else None
        self.tensor_names = tuple(tensor_names)
        self.batch_axis, self.role = batch_axis, role

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        label, where = call_site()
        role = self.role or label
        try:
            collective, x, w, unfold = self._fit(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                                 kwargs)
            batch_axis = self._batch_axis(x)
            check_call(collective, x, w, mesh=self.mesh, axis=self.axis, batch_axis=batch_axis)
        except ValueError as exc:  # _Unfit, or shapes that do not divide over the ring
            return self._plain(role, where, str(exc), lhs, rhs, dimension_numbers, precision,
                               preferred_element_type, kwargs)
        y = self._run(role, where, collective, lhs, x, w, batch_axis).reshape(unfold)
        out_sharding = kwargs.get("out_sharding")
        if out_sharding is not None:
            y = _reshard(y, out_sharding, self.mesh)
        return y

    def _run(self, role, where, collective, lhs, x, w, batch_axis):
        """The op of one call; a column call of an activation an earlier one gathered reuses its gather."""
        share = collective == "allgather_matmul" and getattr(self.source, "share", False)
        where_to = dict(mesh=self.mesh, axis=self.axis, batch_axis=batch_axis)
        found = GATHERS.find(lhs, **where_to) if share else None
        if found is not None and found[0].shape[1:] == x.shape:  # the same activation, folded alike
            stack, group = found
            group.join(role)
            self.source.configs(role, collective, x, w, **where_to, source=where, via="dot_general",
                                gathered_by=group.first)
            return gathered_matmul(stack, w, **where_to, group=group)
        # a served config that does not fit is skipped inside `configs`; a step variant whose edit does
        # not fit raises (`VariantError`): it must fail, not time lax.dot_general under its name
        configs = self.source.configs(role, collective, x, w, **where_to, source=where, via="dot_general")
        if share and configs.forward.method != "xla":
            group = Group(role)

            def summed(n: int) -> Decomposition:  # at the backward's trace, once every reader has joined
                group_w = jax.ShapeDtypeStruct((w.shape[0], n), w.dtype)
                return self.source.configs(group_label(group.roles), collective, x, group_w, **where_to, source=where,
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
        collective = self.kind or self._kind_from_axes(len(rhs_c), rhs.ndim)
        k = math.prod(lhs.shape[d] for d in lhs_c)
        n = math.prod(rhs.shape[len(rhs_c):])
        x = lhs.reshape(*lhs.shape[: lhs.ndim - len(lhs_c)], k)
        w = rhs.reshape(k, n)
        unfold = (*lhs.shape[: lhs.ndim - len(lhs_c)], *rhs.shape[len(rhs_c):])
        return collective, x, w, unfold

    def _kind_from_axes(self, contracted: int, ndim: int) -> str:
        axes = self.kernel_axes
        if len(axes) != ndim:
            raise _Unfit(f"kernel_axes {axes} name {len(axes)} axes, the kernel has {ndim}")
        inputs, outputs = axes[:contracted], axes[contracted:]
        if any(a in self.tensor_names for a in inputs):
            return "matmul_reduce_scatter"
        if any(a in self.tensor_names for a in outputs):
            return "allgather_matmul"
        raise _Unfit(f"kernel_axes {axes} hold no tensor-parallel name {self.tensor_names}: the kernel is not "
                     f"sharded over {self.axis!r}")

    def _batch_axis(self, x):
        if self.batch_axis != AUTO:
            return self.batch_axis
        if x.ndim < 3:
            return None
        others = tuple(a for a in self.mesh.axis_names if a != self.axis and self.mesh.shape[a] > 1)
        size = math.prod(self.mesh.shape[a] for a in others)
        if not others or x.shape[0] % size:
            return None
        return others[0] if len(others) == 1 else others

    def _plain(self, role, where, reason, lhs, rhs, dimension_numbers, precision, preferred, kwargs):
        self.source.fell_back(role, reason, source=where)
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred, **kwargs)

    def __repr__(self) -> str:
        what = self.kind or f"kernel_axes={self.kernel_axes}"
        return f"collective_matmul.client.flax.DotGeneral({what}, axis={self.axis!r})"


class _Unfit(ValueError):
    """A call that does not fit the decomposed ops' layout (it runs ``lax.dot_general``)."""


def dot_general(source: ConfigSource | None, *, mesh: Mesh, axis: str = "model", kind: str | None = None,
                kernel_axes: Sequence[str | None] | None = None, tensor_names: Sequence[str] = TENSOR_NAMES,
                batch_axis=AUTO, role: str | None = None):
    """A ``dot_general`` for a Flax layer that runs ``source``'s configs; ``lax.dot_general`` if ``source`` is None.

    Args:
        source: a `collective_matmul.client.sources.ConfigSource` (a `collective_matmul.Tuned`, a step variant of
            one, fixed configs), or None for the step as written (then this is ``jax.lax.dot_general`` itself).
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis (the ring).
        kind: ``"column"`` (all-gather → matmul) or ``"row"`` (matmul → reduce-scatter).
        kernel_axes: instead of ``kind``, the kernel's logical axes (MaxText style).
        tensor_names: the logical names that ``kernel_axes`` shard over ``axis``.
        batch_axis: the mesh axis (or axes) sharding the input's first dimension; ``"auto"``:
            every other mesh axis, where the batch divides over them.
        role: the calls' role (default: the Flax module path, named scope or source location).

    Raises:
        ValueError: if ``axis`` is not a mesh axis, or neither (or both) of ``kind`` and
            ``kernel_axes`` are given.
    """
    if source is None:
        return lax.dot_general
    return DotGeneral(source, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, tensor_names=tensor_names,
                      batch_axis=batch_axis, role=role)


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
