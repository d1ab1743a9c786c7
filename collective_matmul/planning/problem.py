"""`Problem` and `Hardware`: the keys under which decompositions are tuned and stored."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from collective_matmul.planning.decomposition import (
    ALLGATHER_ACCUMULATE,
    REDUCE_SCATTER_ACCUMULATE,
    Decomposition,
)
from collective_matmul.planning.text import as_label, label


class Collective(StrEnum):
    """The collectives cmtune decomposes with the product that depends on them; each value is the name the keys,
    the wire and the database carry (``allgather_matmul:1024x256x1024:float32:8``)."""

    ALLGATHER_MATMUL = "allgather_matmul"  # the activation gathered on its rows before the product
    MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"  # the product reduce-scattered onto its rows after it
    ALLGATHER_GRAD_WEIGHT = "allgather_grad_weight"  # the weight gradient: all-gather on the contracting rows
    # FSDP's (`collective_matmul.ops.weight_ring`): the weight gathered before its product, sharded on k or on n,
    # and the weight gradient reduce-scattered onto the weight's layout
    WEIGHT_ALLGATHER_MATMUL_K = "weight_allgather_matmul_k"
    WEIGHT_ALLGATHER_MATMUL_N = "weight_allgather_matmul_n"
    REDUCE_SCATTER_GRAD_WEIGHT = "reduce_scatter_grad_weight"


DType = Literal["float32", "bfloat16", "float16"]
# the rings of activations: what every other collective runs as (`Problem.dual`)
ACTIVATION_COLLECTIVES: tuple[Collective, ...] = (Collective.ALLGATHER_MATMUL, Collective.MATMUL_REDUCE_SCATTER,
                                                  Collective.ALLGATHER_GRAD_WEIGHT)
# FSDP's: the weight gathered before its product, sharded on k or on n, and the weight gradient reduce-scattered
# onto the weight's layout (`collective_matmul.ops.weight_ring`)
WEIGHT_COLLECTIVES: tuple[Collective, ...] = (Collective.WEIGHT_ALLGATHER_MATMUL_K,
                                              Collective.WEIGHT_ALLGATHER_MATMUL_N,
                                              Collective.REDUCE_SCATTER_GRAD_WEIGHT)
COLLECTIVES: tuple[Collective, ...] = tuple(Collective)
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# Largest single dimension accepted: 2**24 rows of tokens is far beyond any one ring today,
# and anything larger is almost surely a unit mistake (bytes for elements, say).
MAX_DIM = 1 << 24
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_ALIASES = {"ag": Collective.ALLGATHER_MATMUL, "rs": Collective.MATMUL_REDUCE_SCATTER,
            "gw": Collective.ALLGATHER_GRAD_WEIGHT, "wk": Collective.WEIGHT_ALLGATHER_MATMUL_K,
            "wn": Collective.WEIGHT_ALLGATHER_MATMUL_N, "rsw": Collective.REDUCE_SCATTER_GRAD_WEIGHT}
# The dimensions each collective shards over the ring (besides m, always sharded).
_SHARDED = {Collective.ALLGATHER_MATMUL: "n", Collective.MATMUL_REDUCE_SCATTER: "k",
            Collective.ALLGATHER_GRAD_WEIGHT: "n", Collective.WEIGHT_ALLGATHER_MATMUL_K: "k",
            Collective.WEIGHT_ALLGATHER_MATMUL_N: "n", Collective.REDUCE_SCATTER_GRAD_WEIGHT: "k"}
# A weight collective as the activation ring it runs as: (collective, the dims that become its m, k, n).
_DUALS = {Collective.WEIGHT_ALLGATHER_MATMUL_K: (Collective.ALLGATHER_GRAD_WEIGHT, "k", "n", "m"),
          Collective.WEIGHT_ALLGATHER_MATMUL_N: (Collective.ALLGATHER_MATMUL, "n", "k", "m"),
          Collective.REDUCE_SCATTER_GRAD_WEIGHT: (Collective.MATMUL_REDUCE_SCATTER, "k", "m", "n")}
# The collectives whose ring carries a reduction accumulator (accumulate = its dtype).
_ACCUMULATING = (Collective.MATMUL_REDUCE_SCATTER, Collective.ALLGATHER_GRAD_WEIGHT)


def _canonical(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


class Problem(BaseModel):
    """One collective matmul to tune, with global sizes within one ring.

    ``allgather_matmul``: x ``[m, k]`` sharded on m, w ``[k, n]`` sharded on n.
    ``matmul_reduce_scatter``: x ``[m, k]`` sharded on k, w ``[k, n]`` sharded on k,
    result summed over the ring and sharded on m.
    ``allgather_grad_weight`` (the weight gradient, all-gather on the contracting dimension):
    u ``[m, k]`` sharded on m, v ``[m, n]`` sharded on n, result ``uᵀ v`` ``[k, n]`` sharded on n.
    FSDP's (the weight on the ring; m the rows of the ring's devices, each holding its own):
    ``weight_allgather_matmul_k``: x ``[m, k]`` sharded on m, w ``[k, n]`` sharded on k, gathered before the
    product; ``weight_allgather_matmul_n``: w sharded on n; ``reduce_scatter_grad_weight`` (the weight gradient):
    u ``[m, k]`` and v ``[m, n]`` sharded on m, result ``uᵀ v`` ``[k, n]`` summed over the ring and sharded on k.
    Leading batch dimensions fold into ``m``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    collective: Collective
    m: int = Field(gt=0, le=MAX_DIM)
    k: int = Field(gt=0, le=MAX_DIM)
    n: int = Field(gt=0, le=MAX_DIM)
    dtype: DType
    axis_size: int = Field(gt=0, le=4096)

    @model_validator(mode="after")
    def _divisible_by_ring(self) -> Problem:
        for name in ("m", _SHARDED[self.collective]):
            size = getattr(self, name)
            if size % self.axis_size:
                raise ValueError(
                    f"{self.collective}: {name}={size} is not divisible by axis_size="
                    f"{self.axis_size}; pad {name} to a multiple of {self.axis_size}"
                )
        return self

    @property
    def key(self) -> str:
        """Stable one-line key, e.g. ``allgather_matmul:1024x256x1024:float32:8``."""
        return f"{self.collective}:{self.m}x{self.k}x{self.n}:{self.dtype}:{self.axis_size}"

    @property
    def block_rows(self) -> int:
        """Rows of one ring block (m split over the ring; of the dual's m for a weight collective)."""
        return self.dual.m // self.axis_size

    @property
    def dual(self) -> Problem:
        """The activation ring this problem runs as (itself, but for a weight collective: the same product
        transposed, `collective_matmul.ops.weight_ring`): its space, cost model and bounds are the dual's."""
        if self.collective not in _DUALS:
            return self
        collective, m, k, n = _DUALS[self.collective]
        return Problem(collective=collective, m=getattr(self, m), k=getattr(self, k), n=getattr(self, n),
                       dtype=self.dtype, axis_size=self.axis_size)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def device_bytes(self) -> int:
        """Bytes one device holds to time this problem: its shards of both inputs, two results (the
        baseline's reference and a candidate's) and the baseline's largest intermediate (the whole
        gathered operand, or the unreduced product of a reduce-scatter).  A lower bound: a program's
        temporaries come on top."""
        if self.collective in _DUALS:  # the same arrays, transposed
            return self.dual.device_bytes
        p, elt = self.axis_size, _BYTES[self.dtype]
        m, k, n = self.m, self.k, self.n
        if self.collective == Collective.ALLGATHER_MATMUL:  # x [m/P, k], w [k, n/P] -> [m, n/P]; gathers x [m, k]
            elements = m // p * k + k * n // p + 2 * m * n // p + m * k
        elif self.collective == Collective.MATMUL_REDUCE_SCATTER:  # x [m, k/P], w [k/P, n] -> [m/P, n]; product [m, n]
            elements = m * k // p + k // p * n + 2 * m // p * n + m * n
        else:  # u [m/P, k], v [m, n/P] -> [k, n/P]; gathers u [m, k]
            elements = m // p * k + m * n // p + 2 * k * n // p + m * k
        return elements * elt

    def canonical_json(self) -> str:
        return _canonical(self)

    @classmethod
    def parse(cls, spec: str) -> Problem:
        """Parse a key (``ag:1024x256x1024:float32:8``) or ``key=value`` words.

        Examples: ``allgather_matmul:1024x256x1024:float32:8``,
        ``rs m=1024 k=1024 n=256 dtype=bfloat16 axis_size=8``, ``gw:4096x1024x2048:float32:8``.
        """
        spec = spec.strip()
        match = re.fullmatch(r"(\w+):(\d+)x(\d+)x(\d+):(\w+):(\d+)", spec)
        if match:
            coll, m, k, n, dtype, p = match.groups()
            fields = dict(collective=coll, m=m, k=k, n=n, dtype=dtype, axis_size=p)
        else:
            words = spec.replace(",", " ").split()
            if not words or "=" in words[0]:
                raise ValueError(
                    f"cannot parse problem {spec!r}: start with the collective, e.g. "
                    "'allgather_matmul m=1024 k=256 n=1024 dtype=float32 axis_size=8'"
                )
            fields = {"collective": words[0]}
            for word in words[1:]:
                name, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"cannot parse {word!r} in problem {spec!r}: expected name=value")
                fields[{"p": "axis_size", "ring": "axis_size"}.get(name, name)] = value
        fields["collective"] = _ALIASES.get(fields["collective"], fields["collective"])
        return cls.model_validate(fields)

    def check(self, config: Decomposition) -> None:
        """Raise `ValueError` naming the field and reason if ``config`` cannot run this problem."""
        if self.collective in _DUALS:  # as its activation ring; fuse (keep the gathered weight) is the op's
            if config.fuse and self.collective != Collective.REDUCE_SCATTER_GRAD_WEIGHT:
                raise ValueError(f"fuse=True is not for {self.collective}: it belongs to the weight-gradient config "
                                 "(collective reduce_scatter_grad_weight) of an op's backward; remove fuse")
            check_decomposition(config.model_copy(update={"fuse": False}), collective=self.dual.collective,
                                block_rows=self.block_rows, axis_size=self.axis_size, dtype=self.dtype,
                                rows=f"{_DUALS[self.collective][1]} / axis_size")
            return
        check_decomposition(
            config,
            collective=self.collective,
            block_rows=self.block_rows,
            axis_size=self.axis_size,
            dtype=self.dtype,
        )

    def accepts(self, config: Decomposition) -> bool:
        """True if ``config`` is a valid program for this problem (see `check`)."""
        try:
            self.check(config)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return self.key


def log_distance(a: Problem, b: Problem) -> float:
    """How far apart two shapes are: the sum of ``|log(a/b)|`` over m, k and n (0 for the same shape)."""
    return sum(abs(math.log(getattr(a, f) / getattr(b, f))) for f in ("m", "k", "n"))


def ring_hops(direction: str, axis_size: int) -> tuple[int, int]:
    """Hops made by the two streams of a ring: (first stream, second stream).

    A unidirectional ring makes ``P-1`` hops one way.  A bidirectional ring sends blocks both
    ways at once: ``P//2`` hops one way and ``(P-1)//2`` the other, so every device sees every
    block after about half the steps.
    """
    if direction == "unidirectional":
        return axis_size - 1, 0
    return axis_size // 2, (axis_size - 1) // 2


def loop_trips(config: Decomposition, axis_size: int) -> int:
    """Iterations of the ``fori_loop`` that runs the homogeneous middle of the ring."""
    first, second = ring_hops(config.direction, axis_size)
    return first if config.direction == "unidirectional" else second - 1


def resolved_accumulate(config: Decomposition, *, collective: Collective, dtype: str) -> str:
    """The accumulate mode a ring actually uses (fills in the collective's default)."""
    if config.accumulate is not None:
        return config.accumulate
    if _DUALS.get(collective, (collective,))[0] == Collective.ALLGATHER_MATMUL:
        return "update_slice"
    return "input_dtype" if dtype == "float32" else "float32"


def check_decomposition(
    config: Decomposition, *, collective: Collective, block_rows: int, axis_size: int, dtype: str,
    rows: str = "m / axis_size",
) -> None:
    """Raise `ValueError` if ``config`` is not a valid program for this ring.

    Args:
        config: the candidate.
        collective: ``allgather_matmul``, ``matmul_reduce_scatter`` or ``allgather_grad_weight``.
        block_rows: rows of the m dimension in one ring block (m / axis_size).
        axis_size: devices in the ring.
        dtype: the input dtype name (``float32``, ``bfloat16``, ...).
        rows: what ``block_rows`` is, for the message.

    Raises:
        ValueError: naming the field and the reason.
    """
    if collective not in ACTIVATION_COLLECTIVES:
        known = [str(c) for c in ACTIVATION_COLLECTIVES]
        raise ValueError(f"unknown collective {collective!r}; expected one of {known}")
    if config.fuse and collective != Collective.ALLGATHER_GRAD_WEIGHT:
        raise ValueError(
            f"fuse=True is not for {collective}: it belongs to the weight-gradient config "
            "(collective allgather_grad_weight) of an op's backward; remove fuse"
        )
    if config.method in ("baseline", "xla"):
        return
    allowed = REDUCE_SCATTER_ACCUMULATE if collective in _ACCUMULATING else ALLGATHER_ACCUMULATE
    if config.accumulate is not None and config.accumulate not in allowed:
        raise ValueError(f"accumulate={config.accumulate!r} is not for {collective}; use one of {allowed}")
    if config.accumulate == "float32" and dtype == "float32":
        raise ValueError(
            "accumulate='float32' is the same program as 'input_dtype' for float32 inputs; "
            "use 'input_dtype'"
        )
    if axis_size < 2:
        raise ValueError(f"method='ring' needs axis_size >= 2, got {axis_size}; use the baseline")
    if config.direction == "bidirectional" and axis_size < 3:
        raise ValueError(
            f"direction='bidirectional' needs axis_size >= 3 (got {axis_size}): "
            "with two devices it is the unidirectional ring"
        )
    if block_rows % config.chunks:
        raise ValueError(
            f"chunks={config.chunks} does not divide a block of {block_rows} rows "
            f"({rows}); choose chunks dividing {block_rows}"
        )
    if config.unroll != "full":
        trips = loop_trips(config, axis_size)
        if trips < config.unroll:
            raise ValueError(
                f"unroll={config.unroll} needs a loop of at least {config.unroll} steps, but a "
                f"{config.direction} ring of {axis_size} devices loops {trips} times; use unroll='full'"
            )


# The text of a hardware description: bounded like its columns (hardware.platform, hardware.device_kind);
# versions are stored in JSON, as JAX reports them (a few dozen characters)
Platform = label(64)
DeviceKind = label(128)
Version = label(128, min_length=0)
HardwareKey = label(300)  # hardware.key (`Hardware.key`)
PLATFORM_VERSION_LENGTH = 200
PlatformVersion = label(PLATFORM_VERSION_LENGTH, min_length=0)
FlagsDigest = Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{16})?$")]  # `flags_digest`: empty, or 16 hex

# The code-generation flags are read from these variables, merged as JAX's own compilation cache key merges them
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# Flags that leave the compiled program as it is, left out of `flags_digest`: the virtual device count of the
# host platform (what a test or a CPU worker sets), and the dump flags that only write files (JAX's compilation
# cache leaves out the same ones: `jax._src.cache_key.xla_flags_to_exclude_from_cache_key`)
DEVICE_COUNT_FLAGS = frozenset({"--xla_force_host_platform_device_count"})
FILE_ONLY_FLAG_PREFIXES = ("--xla_dump_",)


def flags_digest(environ: Mapping[str, str] | None = None) -> str:
    """A digest of the code-generation flags in ``environ`` (default `os.environ`): `FLAG_VARIABLES` split
    into flags, those that set device counts or only dump files left out, each flag's last value kept, in
    name order (so their order does not count); empty when no flag is left.

    Examples: ``XLA_FLAGS="--xla_force_host_platform_device_count=8"`` gives ``""``;
    ``"--a=1 --b=2"`` and ``"--b=2 --a=1"`` give the same digest.
    """
    environ = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    for variable in FLAG_VARIABLES:
        for flag in environ.get(variable, "").split():
            name = flag.split("=", 1)[0]
            if name in DEVICE_COUNT_FLAGS or name.startswith(FILE_ONLY_FLAG_PREFIXES):
                continue
            chosen.pop(name, None)
            chosen[name] = flag  # the last one counts, as the flag parser takes it
    if not chosen:
        return ""
    return hashlib.sha256("\n".join(chosen[name] for name in sorted(chosen)).encode()).hexdigest()[:16]


def platform_version_of(text: str) -> str:
    """The backend's platform version as one bounded label (a TPU's spans several lines)."""
    text = as_label(" ".join(text.split()))
    return text[:PLATFORM_VERSION_LENGTH]


class Software(BaseModel):
    """The software stack that compiles and runs a program: part of a tuned config's identity.

    A config measured on one stack is ``stale`` on another (see `collective_matmul.wire.lookup`).  `key` is
    the short stable key the service stores configs under (tuned_configs.software_key).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    jax: Version = ""
    jaxlib: Version = ""
    platform_version: PlatformVersion = Field(
        default="", description="the backend's platform version where JAX reports one (e.g. a TPU runtime's build)")
    flags: FlagsDigest = Field(default="", description="digest of XLA_FLAGS and LIBTPU_INIT_ARGS without the flags "
                                                       "that set device counts or only dump files (`flags_digest`)")

    @property
    def key(self) -> str:
        """16 hex digits of the SHA-256 of the canonical JSON (migration 0008 computes the same for stored
        versions)."""
        return hashlib.sha256(_canonical(self).encode()).hexdigest()[:16]

    @property
    def known(self) -> bool:
        """Whether anything of the stack is known (an old worker or record may say nothing)."""
        return self != Software()

    def canonical_json(self) -> str:
        return _canonical(self)

    @classmethod
    def of(cls, stored: Mapping | None) -> Software:
        """From a stored record (a worker's ``software``, a config's): its known fields, others left out."""
        stored = stored or {}
        return cls(**{name: str(stored[name]) for name in cls.model_fields if stored.get(name)})

    @classmethod
    def detect(cls, device=None, environ: Mapping[str, str] | None = None) -> Software:
        """The running stack: jax, jaxlib, the platform version of ``device``'s backend (the default
        backend's without one), and the flags of ``environ`` (`flags_digest`)."""
        import jax
        import jaxlib

        device = device if device is not None else jax.devices()[0]
        version = getattr(getattr(device, "client", None), "platform_version", "") or ""
        return cls(jax=jax.__version__, jaxlib=jaxlib.__version__, platform_version=platform_version_of(version),
                   flags=flags_digest(environ))

    def __str__(self) -> str:
        """e.g. ``jax 0.10.2, jaxlib 0.10.2, cpu, flags 1f0c...`` (what is known of it)."""
        parts = [f"{name} {value}" for name, value in (("jax", self.jax), ("jaxlib", self.jaxlib)) if value]
        parts += [self.platform_version] if self.platform_version else []
        parts += [f"flags {self.flags}"] if self.flags else []
        return ", ".join(parts) or "an unnamed stack"


def check_slice(device_count: int, slice_devices: int | None) -> None:
    """Raise `ValueError` (what to fix) unless a ring of ``device_count`` devices can be part of a slice of
    ``slice_devices`` (None: the ring is the whole machine)."""
    if slice_devices is not None and slice_devices % device_count:
        raise ValueError(f"a ring of device_count={device_count} is not part of a slice of slice_devices="
                         f"{slice_devices}: slice_devices must be a multiple of device_count")


class Hardware(BaseModel):
    """Where a decomposition runs: the key half that is not the problem.

    ``device_count`` and ``process_count`` are the ring's; ``slice_devices`` the devices of the slice the ring is
    part of, where it is not the whole machine (None: the ring is the whole machine).  A worker of N devices
    tunes a ring of each size dividing N, all of that size at once (`rings`).
    ``jax_version``/``jaxlib_version`` and ``software`` travel with results but are not part of `key`
    (a tuned config carries its stack beside its hardware: `collective_matmul.wire.bundle.TunedConfig`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    platform: Platform
    device_kind: DeviceKind
    device_count: int = Field(gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)
    slice_devices: int | None = Field(default=None, gt=0, le=1 << 20, description=(
        "devices of the slice the ring is part of, a multiple of device_count (None, or device_count: the ring is "
        "the whole machine)"))
    jax_version: Version = ""
    jaxlib_version: Version = ""
    software: Software | None = Field(default=None, description="the stack that measured (`Hardware.detect`)")

    @model_validator(mode="before")
    @classmethod
    def _whole_machine(cls, data):
        """A slice of the ring's own size is the whole machine: None, so that it has one key."""
        if isinstance(data, dict) and data.get("slice_devices") is not None \
                and data.get("slice_devices") == data.get("device_count"):
            data = {**data, "slice_devices": None}
        return data

    @model_validator(mode="after")
    def _ring_of_the_slice(self) -> Hardware:
        check_slice(self.device_count, self.slice_devices)
        return self

    @property
    def key(self) -> str:
        """Stable key without versions, e.g. ``cpu:cpu:8:1``; a ring of part of a slice names the slice's devices,
        e.g. ``cpu:cpu:4:1/8`` (a ring of 4 devices of an 8-device slice)."""
        key = f"{self.platform}:{self.device_kind}:{self.device_count}:{self.process_count}"
        return f"{key}/{self.slice_devices}" if self.slice_devices is not None else key

    def identity(self) -> Hardware:
        """This hardware without software versions (what configs are keyed by, with their `Software` beside)."""
        return self.model_copy(update={"jax_version": "", "jaxlib_version": "", "software": None})

    def canonical_json(self) -> str:
        exclude = {"software"} | ({"slice_devices"} if self.slice_devices is None else set())
        return json.dumps(self.identity().model_dump(mode="json", exclude=exclude), sort_keys=True,
                          separators=(",", ":"))

    def ring(self, size: int) -> Hardware:
        """The hardware of a ring of ``size`` of these devices (itself for ``size`` = `device_count`).

        The rings lie as `collective_matmul.programs.topology.mesh_of` lays the last axis of a mesh of
        ``(devices / size, size)``: on neighbouring devices, so that the first spans the processes its devices fill
        when each process holds an equal run of them (``ceil(size * process_count / device_count)``, what `detect`
        finds there).

        Raises:
            ValueError: ``size`` does not divide `device_count`.
        """
        if size < 1 or self.device_count % size:
            raise ValueError(f"a ring of {size} devices does not divide the {self.device_count} devices of {self.key}; "
                             f"the ring size must divide the hardware's device_count")
        if size == self.device_count:
            return self
        processes = max(1, -(-size * self.process_count // self.device_count))
        return self.model_copy(update={"device_count": size, "process_count": processes,
                                       "slice_devices": self.slice_devices or self.device_count})

    def rings(self) -> list[Hardware]:
        """The hardware of every ring these devices tune: the whole first, then a ring of each size n >= 2 that
        divides `device_count`, largest first (what a worker of this hardware leases)."""
        count = self.device_count
        divisors = {d for i in range(1, math.isqrt(count) + 1) if count % i == 0 for d in (i, count // i)}
        sizes = sorted(divisors - {1, count}, reverse=True)
        return [self, *(self.ring(n) for n in sizes)]

    @classmethod
    def detect(cls, devices=None, slice_devices: int | None = None) -> Hardware:
        """Describe the running JAX runtime (or the given devices: a ring, part of a slice of ``slice_devices``).

        Initialises the JAX backend; call it after `jax.distributed.initialize` on multi-host.
        """
        import jax
        import jaxlib

        devices = list(devices) if devices is not None else jax.devices()
        if not devices:
            raise ValueError("no devices to describe")
        kinds = {d.device_kind for d in devices}
        if len(kinds) > 1:
            raise ValueError(f"mixed device kinds {sorted(kinds)}: tune each kind separately")
        return cls(
            platform=devices[0].platform,
            device_kind=devices[0].device_kind,
            device_count=len(devices),
            process_count=len({d.process_index for d in devices}),
            slice_devices=slice_devices,
            jax_version=jax.__version__,
            jaxlib_version=jaxlib.__version__,
            software=Software.detect(devices[0]),
        )

    def __str__(self) -> str:
        return self.key
