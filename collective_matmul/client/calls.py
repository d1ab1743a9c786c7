"""One op call through a `collective_matmul.client.sources.ConfigSource`: its problems, and the op run with its configs.

`SourceOps` gives a source of configs the ops and the Flax drop-in (`Tuned` inherits them): each op is `run`
over the source, the call's label (its role where the caller names none) and ``file:line`` read at trace time
(`collective_matmul.programs.roles.call_site`), the source answering the call's three configs, and the op
running with them (forward, input and weight gradients).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collective_matmul.client import flax as drop_in
from collective_matmul.ops.collective import OPS, WEIGHT_DIM_OF, BatchAxis, problem_of, weight_allgather_matmul
from collective_matmul.planning.models import WEIGHT_K, WEIGHT_N, slot_problems
from collective_matmul.planning.problem import Collective
from collective_matmul.programs import roles

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

    from collective_matmul.client.sources import ConfigSource
    from collective_matmul.planning.problem import Problem

# the forwards a call may run
COLLECTIVES = (Collective.ALLGATHER_MATMUL, Collective.MATMUL_REDUCE_SCATTER, WEIGHT_K, WEIGHT_N)


def call_problems(collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                  tensor_axis: str | None = None) -> dict[str, Problem]:
    """The problems of one op call, by slot: the forward's from the operands and the mesh, and its backward's.

    Raises:
        ValueError: if ``collective`` is not one of the forward collectives or the shapes do not fit.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"configs: collective must be one of {sorted(map(str, COLLECTIVES))}, got {collective!r}")
    forward = problem_of(collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, tensor_axis=tensor_axis)
    return slot_problems(collective, m=forward.m, k=forward.k, n=forward.n, dtype=forward.dtype,
                         axis_size=forward.axis_size)


def weight_collective(weight_dim: str) -> str:
    """The forward collective of a weight gathered on ``weight_dim`` (FSDP).

    Raises:
        ValueError: if ``weight_dim`` is neither ``k`` nor ``n``.
    """
    collective = {"k": WEIGHT_K, "n": WEIGHT_N}.get(weight_dim)
    if collective is None:
        raise ValueError(f"weight_dim={weight_dim!r}: give 'k' (the weight sharded on its contracting dimension, "
                         "FSDP's usual layout) or 'n' (on its output dimension)")
    return collective


def run(source: ConfigSource, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
        tensor_axis: str | None = None, role: str | None = None) -> jax.Array:
    """``collective``'s op on ``x`` and ``w`` with the configs ``source`` gives this call.

    Args:
        source: answers the call's configs (``source.configs``), at its call site.
        collective: one of `COLLECTIVES`.
        x, w, mesh, axis, batch_axis, tensor_axis: as for the op (``tensor_axis``: a gathered weight's only).
        role: labels the call (default: its label, `collective_matmul.programs.roles.call_site`).

    Raises:
        ValueError: if the call does not fit ``collective``.
    """
    label, site = roles.call_site()
    configs = source.configs(role or label, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis,
                             tensor_axis=tensor_axis, site=site)
    chosen = dict(config=configs.forward, grad_input=configs.grad_input, grad_weight=configs.grad_weight)
    if collective in WEIGHT_DIM_OF:
        return weight_allgather_matmul(x, w, mesh=mesh, axis=axis, weight_dim=WEIGHT_DIM_OF[collective],
                                       batch_axis=batch_axis, tensor_axis=tensor_axis, **chosen)
    return OPS[collective](x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, **chosen)


class SourceOps:
    """The ops and the Flax drop-in, for a `ConfigSource` to inherit (`Tuned` does): each runs with the configs the
    source's own ``configs`` answers."""

    def allgather_matmul(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                         role: str | None = None) -> jax.Array:
        """`collective_matmul.allgather_matmul` with this source's configs (forward, backward); ``role`` labels it."""
        return run(self, Collective.ALLGATHER_MATMUL, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, role=role)

    def matmul_reduce_scatter(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                              role: str | None = None) -> jax.Array:
        """`collective_matmul.matmul_reduce_scatter` with this source's configs (forward, backward); ``role`` labels
        it."""
        return run(self, Collective.MATMUL_REDUCE_SCATTER, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, role=role)

    def weight_allgather_matmul(self, x, w, *, mesh: Mesh, axis: str, weight_dim: str = "k",
                                batch_axis: BatchAxis = None, tensor_axis: str | None = None,
                                role: str | None = None) -> jax.Array:
        """`collective_matmul.weight_allgather_matmul` (FSDP: the weight gathered over ``axis``) with this
        source's configs of its three products; ``role`` labels the call."""
        return run(self, weight_collective(weight_dim), x, w, mesh=mesh, axis=axis, batch_axis=batch_axis,
                   tensor_axis=tensor_axis, role=role)

    def dot_general(self, *, mesh: Mesh, axis: str | None = "model", kind: str | None = None,
                    kernel_axes: tuple | None = None, **options):
        """The Flax drop-in: a ``dot_general`` running these configs (`collective_matmul.client.flax.dot_general`)."""
        return drop_in.dot_general(self, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, **options)

    def dot_general_cls(self, *, mesh: Mesh, axis: str | None = "model", kind: str | None = None,
                        kernel_axes: tuple | None = None, **options):
        """For linen's ``dot_general_cls=``: a factory of `dot_general` (see `collective_matmul.client.flax`)."""
        return drop_in.dot_general_cls(self, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, **options)
