"""One gather for every projection that reads it: the drop-in's column calls of one activation share its ring.

A Llama-shaped layer projects one normed activation three times (query, key, value) and its MLP twice (gate,
up).  Written plainly, XLA gathers that activation once for all of them and, in the backward, sums their
input-gradient partials before one reduce-scatter.  Each of cmtune's ops gathers for itself, so without this
q/k/v on rings would move the activation round the ring three times and reduce-scatter three input gradients.

Within one traced step, the first column call (all-gather → matmul) of an activation runs
`collective_matmul.ops.collective.allgather_matmul_keep`: its ring (or all-gather) also hands back the gathered
activation, one copy per device, which `Gathers` keeps for the traced value.  A later column call of the same
value — the same tracer, in the same trace, on the same mesh, axis, batch axis, shape and dtype — runs
`collective_matmul.ops.collective.gathered_matmul`: its product on the kept copy, with no collective.  The calls of one
gathered activation are a `SharedGather`.  In the backward each later call computes its weight gradient from the
gathered copy and hands its output gradient and weight over to the group (the later calls' backwards run
before the first's); the first op's backward then runs ONE reduce-scatter ring which computes, at every step,
every call's piece of the summed input gradient (each a product of its output gradient's rows and its weight,
no concatenated copy): the group's whole transfer hides behind the group's whole product.  That ring is the
group's summed problem (N the sum of the calls' N): the drop-in looks its config up as such
(``SharedGather.grad_input``) under the group's label (`collective_matmul.programs.roles.group_label`:
``Llama/layers/{key,query,value}``), as discovery lists it.  The memory is what the step as written keeps: the
gathered activation, once.

The forward is the first call's op with its own weight: a call cannot see the weights of the calls after it,
so one ring of the concatenated forward weights is what a user with fused weights (one qkv projection) runs,
an ordinary op of the summed N.

A call whose forward is left to XLA (``method="xla"``) neither keeps nor reuses: XLA shares its own gathers.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
from jax.extend.core import get_opaque_trace_state
from jax.sharding import Mesh

from collective_matmul.planning.decomposition import Decomposition

MAX_KEPT = 64  # gathered activations kept per process (those of the layer being traced are what matter)


def _trace() -> object:
    return get_opaque_trace_state(convention="cmtune")


@dataclass(eq=False)
class SharedGather:
    """The calls of one gathered activation: the call that gathered it (``first``) and those that reused it
    (``readers``), in trace order.  ``grad_input``: the config of the first op's input-gradient ring given the
    group's summed N (None: the first call's own ``grad_input``).  Hashable by identity: a static argument of
    the ops' VJPs."""

    first: str
    readers: list[str] = field(default_factory=list)
    grad_input: Callable[[int], Decomposition] | None = None
    _handed: list = field(default_factory=list)  # (trace, dy, w) of the readers' backwards

    @property
    def roles(self) -> list[str]:
        return [self.first, *self.readers]

    def join(self, role: str) -> None:
        if role != self.first and role not in self.readers:
            self.readers.append(role)

    def hand_over(self, dy: jax.Array, w: jax.Array) -> None:
        """A reader's backward: its output gradient and weight, for the first op's one ring (the same trace).

        It runs before the first op's backward: autodiff transposes a program's equations last to first, and a
        reader's comes after the op whose gathered copy it reads (`tests/collective_matmul/test_share.py` holds
        JAX to it, with the outputs of the group partly unused)."""
        now = _trace()
        self._handed[:] = [h for h in self._handed if h[0] == now]  # a discarded trace's values never count
        self._handed.append((now, dy, w))

    def take(self) -> list[tuple[jax.Array, jax.Array]]:
        """The first op's backward: every ``(dy, w)`` handed over in this trace, in the readers' order."""
        now = _trace()
        mine = [(dy, w) for trace, dy, w in reversed(self._handed) if trace == now]
        self._handed.clear()
        return mine


@dataclass(frozen=True)
class Kept:
    """A gathered activation: the traced value it gathers (held weakly: the entry goes when the value does, at the
    end of its trace), where, the gathered copy, and the group of the calls that read it."""

    lhs: weakref.ref
    trace: object
    mesh: Mesh
    axis: str
    batch_axis: object
    stack: jax.Array
    group: SharedGather


class Gathers:
    """The gathered activations of the calls traced so far, by the traced value they gathered (bounded)."""

    def __init__(self, size: int = MAX_KEPT):
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._size = size

    def find(self, lhs, *, mesh: Mesh, axis: str, batch_axis) -> tuple[jax.Array, SharedGather] | None:
        """``(stack, group)``: what an earlier call (``group.first``) gathered of ``lhs`` on this ring, or None.  Only a
        tracer of the running trace is shared (a concrete array, or a tracer of another trace, never is)."""
        kept = self._kept.get(id(lhs))  # only tracers are kept: `kept.lhs() is lhs` makes this one a tracer
        if (kept is None or kept.lhs() is not lhs or kept.trace != _trace()
                or (kept.mesh, kept.axis, kept.batch_axis) != (mesh, axis, batch_axis)):
            return None
        return kept.stack, kept.group

    def keep(self, lhs, stack, *, mesh: Mesh, axis: str, batch_axis, group: SharedGather) -> None:
        """Remember that ``stack`` is ``lhs`` gathered over ``axis`` (a tracer only: nothing else is shared)."""
        if not isinstance(lhs, jax.core.Tracer):
            return
        key = id(lhs)

        def gone(ref, key=key, kept=self._kept):
            if (entry := kept.get(key)) is not None and entry.lhs is ref:
                del kept[key]

        self._kept[key] = Kept(weakref.ref(lhs, gone), _trace(), mesh, axis, batch_axis, stack, group)
        self._kept.move_to_end(key)
        while len(self._kept) > self._size:
            self._kept.popitem(last=False)


GATHERS = Gathers()  # the process's: a trace is single-threaded, and a kept value is only found by its own tracer
