"""NVIDIA GPU nodes compiled for ahead of time on any host: cards, their target configs, their devices.

XLA's GPU compiler needs no GPU: given a card's target config (a ``GpuTargetConfigProto``: compute capability,
SMs, memory, ...) `jax.experimental.topologies` gives the devices of a node that is not there, and programs
compile for them with the real compiler (``pip install 'cmtune[gpu]'``: JAX's CUDA plugin of the jaxlib in use
and ptxas, no CUDA runtime).  Nothing runs.

Where the config comes from, first found:

1. a card file the user wrote on a real GPU host (`save_card`, ``cmtune gpu-card save NAME``): the node's
   topology as XLA serializes it, kept in `card_dir` as ``NAME.topology``;
2. the configs XLA's GPU backend embeds (``xla/backends/gpu/target_config``), read from the installed plugin:
   the XLA revision of the jaxlib in use, so a config is never older or newer than the compiler that reads it.

`CARDS` names the cards cmtune knows by the device kind XLA reports for them.  A deviceless compile has no
autotuning results, so `deviceless_options` makes every GEMM a cuBLAS call (Triton's GEMMs need autotuning),
unless the user gives autotuning results (``--xla_gpu_load_autotune_results_from`` in ``XLA_FLAGS``).
No JAX at import.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from collective_matmul.programs.topology import TopologyError, compile_only

__all__ = ["CARDS", "GPU_EXTRA", "Card", "GpuError", "card_dir", "compile_options", "deviceless_options", "gpu_devices",
           "deviceless_note", "is_deviceless_gpu", "save_card", "target_config"]

GPU_EXTRA = ("pip install 'cmtune[gpu]' (JAX's CUDA plugin of the installed jaxlib, jax[cuda12-local], and ptxas; "
             "no CUDA runtime is needed to compile)")
PLUGIN = "jax_plugins.xla_cuda12"
ENV_CARD_DIR = "CMTUNE_GPU_CARDS"
# what a deviceless compile sets: cuBLAS GEMMs (Triton's need autotuning results: the flag below gives them), and
# XLA's windowed einsum on one stream (multi-streamed, its async cuBLAS calls fail XLA's HLO verifier in a
# deviceless compile: their workspace is sized s8[33554432] against s8[4194304], seen with jaxlib 0.12.0.1)
DEVICELESS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_multi_streamed_windowed_einsum": False}
GEMM_OPTIONS = ("xla_gpu_enable_triton_gemm",)
AUTOTUNE_RESULTS_FLAG = "--xla_gpu_load_autotune_results_from"


class GpuError(TopologyError):
    """A GPU node that cannot be compiled for here: the plugin is missing, or no config is known for the card."""


@dataclass(frozen=True)
class Card:
    """A GPU card cmtune knows: its short name on the command line and the device kind XLA reports for it."""

    name: str
    device_kind: str
    memory_gib: int


CARDS = {card.name: card for card in (
    Card("a100", "NVIDIA A100-SXM4-80GB", 80),
    Card("a100-40", "NVIDIA A100-SXM4-40GB", 40),
    Card("a100-pcie", "NVIDIA A100 80GB PCIe", 80),
    Card("h100", "NVIDIA H100 80GB HBM3", 80),
    Card("h100-pcie", "NVIDIA H100 PCIe", 80),
    Card("h200", "NVIDIA H200 141GB HBM3e", 141),
    Card("b200", "NVIDIA B200", 180),
    Card("b300", "NVIDIA B300", 270),
    Card("gb200", "NVIDIA GB200", 186),
    Card("gb300", "NVIDIA GB300", 279),
)}
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_KIND = re.compile(r'^device_description_str:\s*"([^"]*)"', re.MULTILINE)


def card_dir() -> Path:
    """Where card files live: ``$CMTUNE_GPU_CARDS``, else ``~/.config/cmtune/gpus``."""
    return Path(os.environ.get(ENV_CARD_DIR) or Path.home() / ".config" / "cmtune" / "gpus")


def _plugin_binary() -> Path:
    spec = importlib.util.find_spec(PLUGIN) if importlib.util.find_spec("jax_plugins") else None
    if spec is None or spec.origin is None:
        raise GpuError(f"compiling for a GPU node needs JAX's CUDA plugin: {GPU_EXTRA}")
    binaries = sorted(Path(spec.origin).parent.glob("*.so"))
    if not binaries:
        raise GpuError(f"JAX's CUDA plugin at {Path(spec.origin).parent} has no library: reinstall it, {GPU_EXTRA}")
    return binaries[0]


@lru_cache(maxsize=2)
def _embedded(binary: Path) -> dict[str, str]:
    """device kind -> the text of its target config, as XLA embeds them in the plugin (NUL-terminated text).

    The library (~465 MB) is scanned through a read-only map, never copied into memory; once per process."""
    configs = {}
    with binary.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for match in re.finditer(rb"\ngpu_device_info\s*\{", data):
            start, end = data.rfind(b"\0", 0, match.start()) + 1, data.find(b"\0", match.start())
            text = data[start:end].decode("utf-8", "replace")
            kind = _KIND.search(text)
            if kind and "cuda_compute_capability" in text:  # NVIDIA's: the CUDA plugin compiles for nothing else
                configs[kind.group(1)] = text
    return configs


def embedded_kinds() -> list[str]:
    """The device kinds the installed plugin has target configs for."""
    return sorted(_embedded(_plugin_binary()))


def target_config(card: str) -> str:
    """The target config text of ``card`` (a name of `CARDS`), as the installed plugin embeds it.

    Raises:
        GpuError: the plugin is missing, the card is unknown, or the plugin has no config for it.
    """
    if card not in CARDS:
        raise GpuError(f"no GPU card {card!r}: cmtune knows {', '.join(CARDS)}; another card's config can be "
                       f"written on a host that has it (cmtune gpu-card save NAME) into {card_dir()}")
    configs = _embedded(_plugin_binary())
    kind = CARDS[card].device_kind
    if kind not in configs:
        raise GpuError(f"the installed CUDA plugin has no target config for {kind!r} ({card}); it has "
                       f"{', '.join(sorted(configs)) or 'none'}: write one on a host with the card "
                       "(cmtune gpu-card save NAME)")
    return configs[kind]


def gpu_devices(card: str, hosts: int = 1, per_host: int = 8) -> list:
    """The devices of a node (or ``hosts`` nodes) of ``per_host`` ``card`` GPUs, compiled for ahead of time here.

    ``card`` is a name of `CARDS` or of a card file in `card_dir`; the devices are numbered host by host, each
    device's ``process_index`` its host.

    Raises:
        GpuError: the CUDA plugin is missing, or no config is known for ``card``.
    """
    if hosts < 1 or per_host < 1:
        raise GpuError(f"a GPU node needs at least one host and one device, got {hosts}x{per_host}")
    _plugin_binary()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs on the GPUs: no CUDA driver is looked for
    from jax.experimental import topologies

    saved = card_dir() / f"{card}.topology"
    if saved.is_file():
        data = _with_shape(saved.read_bytes(), hosts, per_host)
        try:
            return list(topologies.TopologyDescription.deserialize(data).devices)
        except Exception as exc:  # noqa: BLE001 - XLA's error says what it could not read
            raise GpuError(f"the card file {saved} cannot be read by this jaxlib ({type(exc).__name__}: {exc}); "
                           "write it again with this version (cmtune gpu-card save NAME)") from None
    text = target_config(card)
    return list(topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{per_host}",
                                             target_config=text).devices)


def save_card(name: str, devices=None, directory: Path | None = None) -> Path:
    """Write the card file ``name`` from ``devices`` (default: this host's GPUs): the topology XLA serializes
    for them, target config included.  Returns its path.

    Raises:
        GpuError: ``name`` is not a plain name, or the devices are not GPUs.
    """
    if not _NAME.fullmatch(name):
        raise GpuError(f"{name!r}: a card's name is lower-case letters, digits, '.', '_' or '-' (e.g. h100-nvl)")
    import jax
    from jax._src.lib import xla_client

    devices = list(devices if devices is not None else jax.devices())
    if not devices or devices[0].platform != "gpu":
        found = devices[0].platform if devices else "none"
        raise GpuError(f"a card file is written from GPU devices; these are {found} (run it on a host with the card, "
                       "with JAX's CUDA build)")
    directory = Path(directory) if directory is not None else card_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.topology"
    path.write_bytes(xla_client.get_topology_for_devices(devices).serialize())
    return path


def is_deviceless_gpu(devices) -> bool:
    """True when ``devices`` are GPUs compiled for ahead of time (`gpu_devices`), not GPUs of this host."""
    devices = list(devices)
    return bool(devices) and devices[0].platform == "gpu" and compile_only(devices)


def deviceless_options(devices) -> dict:
    """The compile options of a compile for ``devices`` when they are deviceless GPUs, none otherwise.

    `DEVICELESS` (cuBLAS GEMMs: nothing can be autotuned without the GPU) unless ``XLA_FLAGS`` gives autotuning
    results, and the flags a GPU worker runs with for rings to overlap
    (`collective_matmul.planning.xla_options.OVERLAP_FLAGS`) that ``XLA_FLAGS`` does not set: the program compiled
    here is the one a worker would run.
    """
    if not is_deviceless_gpu(devices):
        return {}
    from collective_matmul.planning.xla_options import missing_overlap_flags

    flags = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in DEVICELESS.items() if k not in GEMM_OPTIONS or AUTOTUNE_RESULTS_FLAG not in flags}
    for flag in missing_overlap_flags(flags, "gpu"):
        name, _, value = flag.removeprefix("--").partition("=")
        options[name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return options


def compile_options(devices, options: dict | None = None) -> dict:
    """``options`` over what a compile for ``devices`` needs when they are deviceless GPUs (`deviceless_options`):
    the options of every compile-only compile."""
    return {**deviceless_options(devices), **(options or {})}


def deviceless_note(options: dict) -> str:
    """What a deviceless GPU compile set, in words (empty when nothing)."""
    if not options:
        return ""
    gemm = ("GEMMs as cuBLAS calls (xla_gpu_enable_triton_gemm=false: no GPU to autotune Triton's; give "
            f"{AUTOTUNE_RESULTS_FLAG} in XLA_FLAGS to compile with yours)" if "xla_gpu_enable_triton_gemm" in options
            else "GEMMs from the autotuning results in XLA_FLAGS")
    stream = ("; XLA's windowed einsum on one stream (xla_gpu_multi_streamed_windowed_einsum=false: its "
              "multi-streamed form fails XLA's verifier without a GPU)"
              if "xla_gpu_multi_streamed_windowed_einsum" in options else "")
    rest = ", ".join(f"{k}={str(v).lower()}" for k, v in options.items() if k not in DEVICELESS)
    return f"compiled without a GPU: {gemm}{stream}" + (f"; as a GPU worker runs: {rest}" if rest else "")


# ---- the serialized topology's node shape (protobuf's wire format, the three counts only) ---------------------

# PjRtTopologyDescriptionProto field 9 (an Any) holds the GpuTopologyProto, whose fields 4, 5 and 6 are the
# partitions, the hosts per partition and the devices per host
_ANY, _ANY_VALUE = 9, 2


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of a message: varints as ints, the rest as their bytes."""
    fields, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, at = _varint(data, at)
        elif kind == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
            value, at = data[at:at + size], at + size
        else:
            raise GpuError(f"a card file with a field of wire type {kind}: not a topology XLA wrote")
        fields.append((number, kind, value))
    return fields


def _message(fields: list[tuple[int, int, bytes | int]]) -> bytes:
    out = bytearray()
    for number, kind, value in fields:
        out += _encode_varint(number << 3 | kind)
        if kind == 0:
            out += _encode_varint(value)
        elif kind == 2:
            out += _encode_varint(len(value)) + value
        else:
            out += value
    return bytes(out)


def _with_shape(data: bytes, hosts: int, per_host: int) -> bytes:
    """A serialized GPU topology with its node shape set to one partition of ``hosts`` x ``per_host``."""
    counts = {4: 1, 5: hosts, 6: per_host}

    def gpu(topology: bytes) -> bytes:
        kept = [f for f in _fields(topology) if f[0] not in counts]
        return _message(kept + [(number, 0, value) for number, value in counts.items()])

    def any_(message: bytes) -> bytes:
        return _message([(n, k, gpu(v) if n == _ANY_VALUE else v) for n, k, v in _fields(message)])

    fields = _fields(data)
    if not any(n == _ANY and k == 2 for n, k, _ in fields):
        raise GpuError("a card file without a GPU topology: not one cmtune gpu-card save wrote")
    return _message([(n, k, any_(v) if n == _ANY and k == 2 else v) for n, k, v in fields])
