"""Analytic cost model of the decompositions: orders and seeds the search, and answers a look-up nothing
measured answers where the caller asks for it (`collective_matmul.wire.lookup.untuned`).

The model, per problem on a ring of P devices:

1. A matmul of ``r`` rows runs at ``peak * r / (r + half_rows)``: small pieces waste the unit.
2. A message of ``b`` bytes over one link takes ``latency + b / link_bandwidth``; every
   collective op costs ``op_s`` to issue and synchronise.
3. Baseline: the whole collective (one op, P-1 hops), then the whole matmul; nothing overlaps.
4. Ring: one step per hop; within a step, the permutes of the next step run while the current
   block's pieces are multiplied, so a step costs ``max(compute, transfer)`` where the hardware
   overlaps them (``compute + transfer`` where it does not), plus a per-op launch overhead.
   Bidirectional rings make ``P//2`` steps with two blocks of compute each; the two directions
   share the links only if the links are not full duplex.  Fill and drain: the first block's
   matmul (all-gather) or the first partial product (reduce-scatter) has nothing to hide behind.
5. ``fori_loop`` rings pay a loop overhead per iteration (halved by unroll 2); ``concat`` pays
   one extra pass over the output; a float32 accumulator doubles the bytes moved for 16-bit
   inputs.
6. Weight gradient (``allgather_grad_weight``, u ``[m, k]`` gathered, v ``[m, n/P]`` local): the
   blocks of u move as an all-gather's do (``m/P x k`` per block, nothing else on the links) and
   each block's product ``[k, n/P]`` contracts its ``m/P`` rows.  The accumulator stays on the
   device: every piece's product is added into it, a read and a write of ``k x n/P`` accumulator
   elements per piece (memory traffic, not link traffic), which ``chunks`` multiplies and a
   float32 accumulator doubles on 16-bit inputs.  The baseline gathers u whole, then contracts
   once.  ``fuse`` is not modelled: it couples two problems and is measured in the training step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Collective, Hardware, Problem, resolved_accumulate, ring_hops

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class HardwareProfile(BaseModel):
    """Rates of one accelerator and its ring links (peak figures, or calibrated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    flops_per_s: dict[str, float] = Field(description="matmul peak by dtype name")
    link_bytes_per_s: float = Field(gt=0, description="one direction of one ring link")
    latency_s: float = Field(ge=0, description="per-hop latency of a transfer")
    op_s: float = Field(default=5e-6, ge=0, description="fixed cost of issuing one collective op "
                        "(a ring pays it per permute, the baseline once)")
    memory_bytes_per_s: float = Field(gt=0)
    duplex: bool = True
    overlap: bool = True
    half_rows: float = Field(default=64.0, ge=0, description="rows at which a matmul runs at half peak")
    launch_s: float = Field(default=2e-6, ge=0, description="per-op launch/schedule overhead")
    loop_s: float = Field(default=5e-6, ge=0, description="per fori_loop iteration overhead")
    source: str = ""
    # what the predictor of compiled programs (`collective_matmul.programs.predict`) needs besides the above
    matmul_efficiency: dict[str, float] = Field(
        default_factory=dict, description="fraction of the peak a large product reaches, by dtype name (1 if absent)")
    efficiency_source: str = ""
    wraparound_from: int | None = Field(
        default=None, ge=2, description="the smallest ring whose ends are linked (a torus axis of that many "
        "devices or more has two links into each device, one from each side; a shorter one is a line, whose ends "
        "have one); None: a switch (NVLink), ``link_bytes_per_s`` being a device's whole one-way bandwidth")
    links_source: str = ""


# What fraction of the dense peak a large product reaches: general figures, never fitted to one benchmark.
_GPU_EFFICIENCY = {"bfloat16": 0.75, "float16": 0.75, "float32": 0.75}
_GPU_EFFICIENCY_SOURCE = ("a round general figure: large FP16/BF16 cuBLAS GEMMs on Hopper run at roughly three "
                          "quarters of the dense tensor-core peak in public GEMM benchmarks; not fitted here")
_TPU_EFFICIENCY = {"bfloat16": 0.9, "float32": 0.9}
_TPU_EFFICIENCY_SOURCE = ("a round general figure: a large bf16 product keeps the MXUs nearly busy (How to Scale "
                          "Your Model's rooflines assume the peak); not measured here")

# Published peak figures (dense, per chip); link = one direction of one neighbour link.
PROFILES: dict[str, HardwareProfile] = {
    "tpu-v4": HardwareProfile(
        name="tpu-v4", flops_per_s={"bfloat16": 275e12, "float32": 275e12 / 4},
        link_bytes_per_s=50e9, latency_s=5e-6, memory_bytes_per_s=1.2e12,
        source="Google Cloud TPU v4 docs: 275 TFLOPS bf16, 1.2 TB/s HBM, 6 ICI links",
        matmul_efficiency=_TPU_EFFICIENCY, efficiency_source=_TPU_EFFICIENCY_SOURCE, wraparound_from=4,
        links_source="How to Scale Your Model (scaling-book): v4 and v5p are 3D tori, an axis of 4 or more (a full "
                     "cube's) has wraparound links",
    ),
    "tpu-v5e": HardwareProfile(
        name="tpu-v5e", flops_per_s={"bfloat16": 197e12, "float32": 197e12 / 4},
        link_bytes_per_s=45e9, latency_s=5e-6, memory_bytes_per_s=0.81e12,
        source="Google Cloud TPU v5e docs: 197 TFLOPS bf16, 819 GB/s HBM, 1600 Gbps ICI",
        matmul_efficiency=_TPU_EFFICIENCY, efficiency_source=_TPU_EFFICIENCY_SOURCE, wraparound_from=16,
        links_source="How to Scale Your Model (jax-ml scaling-book, rooflines and sharding chapters): v5e ICI "
                     "4.5e10 B/s one way per link, 8.1e11 B/s HBM; a 2D torus with wraparound only on a full axis "
                     "of 16",
    ),
    "tpu-v5p": HardwareProfile(
        name="tpu-v5p", flops_per_s={"bfloat16": 459e12, "float32": 459e12 / 4},
        link_bytes_per_s=100e9, latency_s=5e-6, memory_bytes_per_s=2.76e12,
        source="Google Cloud TPU v5p docs: 459 TFLOPS bf16, 2.76 TB/s HBM, 4800 Gbps ICI",
        matmul_efficiency=_TPU_EFFICIENCY, efficiency_source=_TPU_EFFICIENCY_SOURCE, wraparound_from=4,
        links_source="How to Scale Your Model (scaling-book): v4 and v5p are 3D tori, an axis of 4 or more (a full "
                     "cube's) has wraparound links",
    ),
    "h100-nvlink": HardwareProfile(
        name="h100-nvlink", flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        link_bytes_per_s=450e9, latency_s=8e-6, memory_bytes_per_s=3.35e12, half_rows=128,
        source="NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s, NVLink 900 GB/s",
        matmul_efficiency=_GPU_EFFICIENCY, efficiency_source=_GPU_EFFICIENCY_SOURCE,
        links_source="NVIDIA datasheet: NVLink 4 through NVSwitch, 900 GB/s per GPU both ways (450 GB/s one way)",
    ),
    "h200-nvlink": HardwareProfile(
        name="h200-nvlink", flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        link_bytes_per_s=450e9, latency_s=8e-6, memory_bytes_per_s=4.8e12, half_rows=128,
        source="NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s, NVLink 900 GB/s",
        matmul_efficiency=_GPU_EFFICIENCY, efficiency_source=_GPU_EFFICIENCY_SOURCE,
        links_source="NVIDIA datasheet: NVLink 4 through NVSwitch, 900 GB/s per GPU both ways (450 GB/s one way)",
    ),
    # Virtual CPU devices share the host's cores: transfers are memory copies that compete with
    # the matmuls, so nothing overlaps.  `calibrate_cpu` measures these rates on the spot (for
    # studying the model; the engine orders candidates with this static profile).
    "cpu": HardwareProfile(
        name="cpu", flops_per_s={"float32": 50e9, "bfloat16": 10e9, "float16": 10e9},
        link_bytes_per_s=5e9, latency_s=30e-6, memory_bytes_per_s=10e9, overlap=False,
        half_rows=16, launch_s=20e-6, loop_s=20e-6, source="defaults; see calibrate_cpu",
    ),
    # A device kind cmtune has no figures for: an overlapping accelerator of middling rates, so the
    # order of candidates is plausible until measurements take over.
    "generic": HardwareProfile(
        name="generic", flops_per_s={"bfloat16": 200e12, "float16": 200e12, "float32": 50e12},
        link_bytes_per_s=50e9, latency_s=10e-6, memory_bytes_per_s=1e12,
        source="no published figures: middling accelerator rates",
    ),
}


# Device kinds as JAX reports them -> profile.  A kind not here has no figures: `profile_for` gives None
# (the engine then orders candidates with ``generic``: `cmtune.tuner.search_studies.profile_name_for`).
DEVICE_KINDS: dict[str, str] = {
    "cpu": "cpu",
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5p": "tpu-v5p",
    "TPU v5": "tpu-v5p",  # what libtpu's compile-only v5p devices report
}
# GPUs report the product's name, with a suffix per variant (memory, form factor): these prefixes
# (case as reported) name the NVLink parts the figures are for; an H100 PCIe ("NVIDIA H100 PCIe") is not one.
DEVICE_KIND_PREFIXES: tuple[tuple[str, str], ...] = (
    ("NVIDIA H100 80GB HBM3", "h100-nvlink"),  # H100 SXM5
    ("H100", "h100-nvlink"),
    ("NVIDIA H200", "h200-nvlink"),
    ("H200", "h200-nvlink"),
)


def profile_for(hardware: Hardware) -> HardwareProfile | None:
    """The profile of ``hardware``'s device kind (`DEVICE_KINDS`, then `DEVICE_KIND_PREFIXES`), or None for a
    kind without figures (say so with `no_figures`)."""
    return profile_of_kind(hardware.device_kind)


def profile_of_kind(kind: str) -> HardwareProfile | None:
    """The profile of a device kind as JAX reports it (``TPU v5 lite``, ``NVIDIA H100 80GB HBM3``), or None."""
    name = DEVICE_KINDS.get(kind) or next((n for prefix, n in DEVICE_KIND_PREFIXES if kind.startswith(prefix)), None)
    return PROFILES[name] if name is not None else None


def no_figures(hardware: Hardware) -> str:
    """What to tell a user whose hardware `profile_for` has no profile for."""
    return f"no cost-model figures for device kind {hardware.device_kind!r}"


def estimate(problem: Problem, config: Decomposition, profile: HardwareProfile) -> float:
    """Estimated seconds of one call of ``config`` on ``problem`` (a weight collective's: its dual's, the same ring
    on the transposed product)."""
    problem = problem.dual
    p = problem.axis_size
    elt = _BYTES[problem.dtype]
    peak = profile.flops_per_s.get(problem.dtype) or max(profile.flops_per_s.values())
    rows = problem.m // p

    def matmul(r: float, flops: float) -> float:
        return flops / (peak * r / (r + profile.half_rows)) + profile.launch_s

    def message(nbytes: float) -> float:
        return profile.latency_s + nbytes / profile.link_bytes_per_s

    acc_bytes = 0.0  # local accumulator traffic per piece (weight gradient)
    if problem.collective == Collective.ALLGATHER_MATMUL:
        block_bytes = rows * problem.k * elt
        block_flops = 2 * rows * problem.k * (problem.n // p)
        out_bytes = problem.m * (problem.n // p) * elt
    elif problem.collective == Collective.ALLGATHER_GRAD_WEIGHT:
        acc = resolved_accumulate(config, collective=problem.collective, dtype=problem.dtype)
        acc_elt = 4 if (config.method == "ring" and acc == "float32") else elt
        block_bytes = rows * problem.k * elt
        block_flops = 2 * rows * problem.k * (problem.n // p)
        out_bytes = problem.k * (problem.n // p) * elt
        acc_bytes = 2 * problem.k * (problem.n // p) * acc_elt
    else:
        acc = resolved_accumulate(config, collective=problem.collective, dtype=problem.dtype)
        acc_elt = 4 if (config.method == "ring" and acc == "float32") else elt
        block_bytes = rows * problem.n * acc_elt
        block_flops = 2 * rows * (problem.k // p) * problem.n
        out_bytes = rows * problem.n * elt

    if config.method in ("baseline", "xla"):  # XLA's own: no figures for its windowed einsum, priced as written
        collective = profile.op_s + (p - 1) * message(block_bytes)
        compute = matmul(problem.m, block_flops * p)
        if problem.collective == Collective.MATMUL_REDUCE_SCATTER:
            collective += (p - 1) * block_bytes / profile.memory_bytes_per_s  # the reductions
        return collective + compute

    c = config.chunks
    hops_a, hops_b = ring_hops(config.direction, p)
    streams = 1 if config.direction == "unidirectional" else 2
    piece_compute = matmul(rows / c, block_flops / c)
    step_compute = streams * c * piece_compute
    share = 1 if (profile.duplex or streams == 1) else 2
    # every permute is its own op (issued one after another); the bytes share links only
    # when two streams go the same way over half-duplex links
    step_transfer = streams * c * profile.op_s + share * c * message(block_bytes / c)
    if problem.collective == Collective.MATMUL_REDUCE_SCATTER:
        step_compute += streams * block_bytes / profile.memory_bytes_per_s  # the adds
    step_compute += streams * c * acc_bytes / profile.memory_bytes_per_s  # local accumulator adds
    step = max(step_compute, step_transfer) if profile.overlap else step_compute + step_transfer
    total = c * piece_compute + hops_a * step  # fill (first block) + one step per hop
    if config.unroll != "full":
        trips = (p - 1) if config.direction == "unidirectional" else max(hops_b - 1, 0)
        total += trips / config.unroll * profile.loop_s
    if config.accumulate == "concat":
        total += 2 * out_bytes / profile.memory_bytes_per_s
    return total


def rank(problem: Problem, configs, profile: HardwareProfile) -> list[Decomposition]:
    """``configs`` from fastest to slowest by the model (stable for ties)."""
    return sorted(configs, key=lambda config: estimate(problem, config, profile))


def model_choice(problem: Problem, hardware: Hardware) -> Decomposition | None:
    """The model's favourite for ``problem`` on ``hardware``'s published profile (None: no profile)."""
    from collective_matmul.planning.space import candidates

    profile = profile_for(hardware)
    return rank(problem, candidates(problem), profile)[0] if profile is not None else None


def calibrate_cpu(devices=None, *, repeats: int = 5) -> HardwareProfile:
    """Measure a CPU profile on the running (virtual) devices: matmul rate and permute cost.

    Takes about a second: a 512x512 matmul on the first device, and a ring permute over all of
    them, of a small and of a 1 MiB block (latency and bandwidth).
    """
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    devices = list(devices) if devices is not None else jax.devices()

    def best_of(fn, *args) -> float:
        fn(*args).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    n = 512
    a = jax.device_put(jnp.ones((n, n), jnp.float32), devices[0])
    flops = 2 * n**3 / best_of(jax.jit(lambda x: x @ x), a)
    mesh = jax.make_mesh((len(devices),), ("r",), devices=devices)
    shift = jax.jit(jax.shard_map(
        lambda x: jax.lax.ppermute(x, "r", [(i, (i + 1) % len(devices)) for i in range(len(devices))]),
        mesh=mesh, in_specs=P("r"), out_specs=P("r"),
    ))
    small = jax.device_put(jnp.ones((len(devices), 8), jnp.float32), jax.sharding.NamedSharding(mesh, P("r")))
    big_rows = 1 << 18
    big = jax.device_put(jnp.ones((len(devices) * big_rows,), jnp.float32), jax.sharding.NamedSharding(mesh, P("r")))
    latency = best_of(shift, small)
    bandwidth = big_rows * 4 / max(best_of(shift, big) - latency, 1e-9)
    base = PROFILES["cpu"]
    return base.model_copy(update=dict(
        flops_per_s={"float32": flops, "bfloat16": flops / 4, "float16": flops / 4},
        link_bytes_per_s=bandwidth, latency_s=latency, memory_bytes_per_s=bandwidth,
        source=f"calibrated on {len(devices)} {devices[0].device_kind} devices",
    ))
