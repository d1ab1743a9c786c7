"""One gather for every projection that reads it: the drop-in's column calls of one activation share its ring.

A Llama-shaped layer projects one normed activation three times (query, key, value) and its MLP twice (gate,
up).  Written plainly, XLA gathers that activation once for all of them and, in the backward, sums their
input-gradient partials before one reduce-scatter.  Each of cmtune's ops gathers for itself, so without this
q/k/v on rings would move the activation round the ring three times and reduce-scatter three input gradients.

Within one traced step, the first column call (all-gather → matmul) of an activation runs
`collective_matmul.ops.allgather_matmul_keep`: its ring (or all-gather) also hands back the gathered
activation, one copy per device, which `Gathers` keeps for the traced value.  A later column call of the same
value — the same tracer, in the same trace, on the same mesh, axis, batch axis, shape and dtype — runs
`collective_matmul.ops.gathered_matmul`: its product on the kept copy, with no collective.  Autodiff sums the
later products' input gradients into the gathered value's cotangent, which the first op adds to its own
partial before its one reduce-scatter; every weight gradient is a product with the one gathered activation.
The memory is what the step as written keeps: the gathered activation, once.

A call whose forward is left to XLA (``method="xla"``) neither keeps nor reuses: XLA shares its own gathers.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import jax
from jax.extend.core import get_opaque_trace_state
from jax.sharding import Mesh

MAX_KEPT = 64  # gathered activations kept per process (those of the layer being traced are what matter)


@dataclass(frozen=True)
class Kept:
    """A gathered activation: the traced value it gathers (held weakly: the entry goes when the value does, at the
    end of its trace), where, the gathered copy, and the role of the call that gathered it."""

    lhs: weakref.ref
    trace: object
    mesh: Mesh
    axis: str
    batch_axis: object
    stack: jax.Array
    role: str


class Gathers:
    """The gathered activations of the calls traced so far, by the traced value they gathered (bounded)."""

    def __init__(self, size: int = MAX_KEPT):
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._size = size

    def find(self, lhs, *, mesh: Mesh, axis: str, batch_axis) -> tuple[jax.Array, str] | None:
        """``(stack, role)``: what an earlier call (``role``) gathered of ``lhs`` on this ring, or None.  Only a
        tracer of the running trace is shared (a concrete array, or a tracer of another trace, never is)."""
        kept = self._kept.get(id(lhs))  # only tracers are kept: `kept.lhs() is lhs` makes this one a tracer
        if (kept is None or kept.lhs() is not lhs or kept.trace != get_opaque_trace_state(convention="cmtune")
                or (kept.mesh, kept.axis, kept.batch_axis) != (mesh, axis, batch_axis)):
            return None
        return kept.stack, kept.role

    def keep(self, lhs, stack, *, mesh: Mesh, axis: str, batch_axis, role: str) -> None:
        """Remember that ``stack`` is ``lhs`` gathered over ``axis`` (a tracer only: nothing else is shared)."""
        if not isinstance(lhs, jax.core.Tracer):
            return
        key = id(lhs)

        def gone(ref, key=key, kept=self._kept):
            if (entry := kept.get(key)) is not None and entry.lhs is ref:
                del kept[key]

        self._kept[key] = Kept(weakref.ref(lhs, gone), get_opaque_trace_state(convention="cmtune"), mesh, axis,
                               batch_axis, stack, role)
        self._kept.move_to_end(key)
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)


GATHERS = Gathers()  # the process's: a trace is single-threaded, and a kept value is only found by its own tracer
