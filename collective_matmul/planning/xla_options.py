"""The XLA options a backend's own decomposition of collective matmuls is set with (its *windowed einsum*).

XLA's SPMD partitioner can itself rewrite an all-gather → dot or a dot → reduce-scatter as a loop of
collective-permutes and partial dots, above a size threshold: on TPU by default, on GPU when asked.  cmtune
times that as a candidate family of its own (``method="xla"``), and discovery compiles a step with it off to
see the plain collectives it rewrites.  CPU has no windowed einsum: no options, nothing extra is timed there.
"""

from __future__ import annotations

# per platform: the options that turn XLA's windowed einsum off (plain collectives) and on (at any size).  On TPU
# the threshold (xla_jf_spmd_threshold_for_windowed_einsum_mib) only lowers the bar of a cost check that still
# refuses small products and every product on some slices (v5p:2x2x1 at 8192x4096x16384): what forces the loop,
# at any size and on every slice compiled here, is libtpu's post-SPMD collective matmul (its "V2").
WINDOWED_EINSUM: dict[str, dict[str, dict[str, object]]] = {
    "tpu": {
        "off": {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False},
        "on": {"xla_tpu_all_gather_collective_matmul_mode": "post_spmd",
               "xla_tpu_reduce_scatter_collective_matmul_mode": "post_spmd"},
    },
    "gpu": {  # not compiled here: the options of the pinned XLA, as its debug options name them
        "off": {"xla_gpu_threshold_for_windowed_einsum_mib": 1_000_000},
        "on": {"xla_gpu_threshold_for_windowed_einsum_mib": 0},
    },
}
PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def windowed_einsum(platform: str, setting: str) -> dict[str, object] | None:
    """The compile options that turn XLA's windowed einsum ``setting`` (``on`` or ``off``) on ``platform``, or None
    where the backend has none (CPU)."""
    if setting not in ("on", "off"):
        raise ValueError(f"windowed einsum is 'on' or 'off', got {setting!r}")
    return WINDOWED_EINSUM.get(PLATFORM_ALIASES.get(platform, platform), {}).get(setting)


# the XLA flags a GPU needs for a ring to overlap at all: the latency-hiding scheduler moves a permute's start
# ahead of independent work, and the parallel collective limit lets a bidirectional ring's two streams run at once
OVERLAP_FLAGS: dict[str, tuple[str, ...]] = {
    "gpu": ("--xla_gpu_enable_latency_hiding_scheduler=true",
            "--xla_gpu_experimental_parallel_collective_overlap_limit=2"),
}


def with_overlap_flags(xla_flags: str, platform: str) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with the overlap flags of ``platform`` a flag of the same name does not
    set already (a user's own value wins)."""
    return " ".join([*xla_flags.split(), *missing_overlap_flags(xla_flags, platform)])


def missing_overlap_flags(xla_flags: str, platform: str) -> list[str]:
    """The overlap flags of ``platform`` that ``xla_flags`` does not set (whatever their value there)."""
    names = {f.split("=", 1)[0] for f in xla_flags.split()}
    return [f for f in OVERLAP_FLAGS.get(PLATFORM_ALIASES.get(platform, platform), ())
            if f.split("=", 1)[0] not in names]
