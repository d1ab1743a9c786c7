"""Comparing what a program computed with what it should have: values and updates, leaf by leaf (in the spirit
of chex's ``assert_trees_all_close``), each kernel jitted once and kept.

`terms` is the one comparison every check rests on: in float32, how far ``got`` is from ``want`` (a norm), the
size it is measured against (``want``'s norm, or for an update from ``base`` how far the step moved it), and the
elements of an update off by more than a tolerance of that move.  The rules that turn terms into a verdict are
the checks' own: an op against the baseline (`cmtune.workers.measure`), the reference block's step
(`cmtune.workers.step`), a user's step (`cmtune.workers.userstep`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Terms:
    """One leaf's comparison, in float32."""

    diff: float  # |got - want|
    size: float  # |want|, or |want - base| for an update from ``base``
    off: int  # elements of an update that miss ``want`` by more than the tolerance allows (0 for a value)

    @property
    def relative(self) -> float:
        """``diff / size`` (``diff`` itself where the size is 0)."""
        return self.diff / self.size if self.size else self.diff


def terms(got, want, base=None, *, tolerance: float = 0.0, eps: float = 0.0) -> Terms:
    """Compare one leaf ``got`` with ``want``: a value (``base`` None), or an update from ``base``.

    An element of an update is off when it misses ``want``'s by more than ``tolerance`` times how far
    the step moved it (that element's move plus the leaf's root-mean-square move, so that an
    element the step barely moved is not held to nothing) plus ``eps``, the rounding of storing it.
    """
    diff, size, off = _terms()(got, want, base, tolerance, eps)
    return Terms(diff=float(diff), size=float(size), off=int(off))


def tree_terms(got, want, base=None) -> list[Terms]:
    """`terms` of every leaf of the trees ``got`` and ``want`` (and ``base``), in ``want``'s leaf order."""
    import jax

    bases = jax.tree.leaves(base) if base is not None else [None] * len(jax.tree.leaves(want))
    return [terms(g, w, b) for g, w, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), bases, strict=True)]


def relative_error(got, want, base=None) -> float:
    """``|got - want| / |want|`` in float32 (from ``base``: over ``|want - base|``); the difference where the size
    is 0."""
    return terms(got, want, base).relative


def equal(a, b) -> bool:
    """Every element the same (integers, booleans, key data: compared exactly)."""
    return bool(_equal()(a, b))


@functools.cache
def _terms():
    import jax
    import jax.numpy as jnp

    def kernel(got, want, base, tolerance, eps):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        diff = jnp.linalg.norm(got - want)
        if base is None:
            return diff, jnp.linalg.norm(want), jnp.int32(0)
        base = base.astype(jnp.float32)
        move = jnp.abs(want - base)
        typical = jnp.sqrt(jnp.mean(jnp.square(move)))
        allowed = tolerance * (move + typical) + 2 * eps * jnp.abs(want)
        return diff, jnp.linalg.norm(want - base), jnp.sum(jnp.abs(got - want) > allowed)

    return jax.jit(kernel)


@functools.cache
def _equal():
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda a, b: jnp.array_equal(a, b))
