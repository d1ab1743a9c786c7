"""Compiling past JAX's persistent compilation cache, through its public API (no JAX at import)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def past_persistent_cache() -> Iterator[None]:
    """Compile for real inside: JAX's persistent compilation cache (MaxText turns it on) neither read nor written.

    A compile served from the cache runs none of XLA's passes, so it writes no partitioned module to read (the
    dump options are left out of the cache key).  JAX decides once per process whether the cache is used (on the
    first compile), so turning ``jax_enable_compilation_cache`` off after that changes nothing by itself: the cache
    is reset too (`jax.experimental.compilation_cache.compilation_cache.reset_cache`), so that the compiles inside
    ask again and are told "no".  On the way out the option gets its old value and the cache is reset again: the
    next compile opens the user's cache as before.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
