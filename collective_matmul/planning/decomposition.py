"""`Decomposition`: one candidate way to run a collective matmul."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

Method = Literal["baseline", "ring", "xla"]
Direction = Literal["unidirectional", "bidirectional"]
Unroll = Literal["full", 1, 2]
# All-gather side: how output blocks are assembled.  Reduce-scatter side: the dtype of the
# accumulator that travels round the ring.  Weight-gradient side: the dtype of the local
# accumulator (the reduce-scatter values).
Accumulate = Literal["update_slice", "concat", "input_dtype", "float32"]

ALLGATHER_ACCUMULATE: tuple[str, ...] = ("update_slice", "concat")
REDUCE_SCATTER_ACCUMULATE: tuple[str, ...] = ("input_dtype", "float32")
CHUNK_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
UNROLL_CHOICES: tuple[Unroll, ...] = ("full", 1, 2)

_SHORT = {
    "unidirectional": "uni",
    "bidirectional": "bi",
    "update_slice": "dus",
    "concat": "cat",
    "input_dtype": "in",
    "float32": "f32",
}


class Decomposition(BaseModel):
    """One candidate decomposition of a collective matmul.

    Fields are independent knobs; each value gives a distinct program.  ``accumulate=None``
    means the collective's default (``update_slice`` for the all-gather side; for the
    reduce-scatter and weight-gradient sides ``float32`` on 16-bit inputs, else the input
    dtype).  The ring fields must keep their defaults when ``method="baseline"`` so that there is
    exactly one baseline (and one fused baseline).

    ``fuse`` is only for a weight-gradient config (collective ``allgather_grad_weight``) used in
    the backward of an op: one loop serves both where two loops would move the same blocks (see
    ``docs/decompositions.md``).  It is left out of the JSON when false, so the JSON of every
    unfused config is what it was before the field existed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method = "ring"
    direction: Direction = "unidirectional"
    chunks: int = Field(default=1, ge=1, le=64)
    unroll: Unroll = "full"
    accumulate: Accumulate | None = None
    fuse: bool = False

    @field_validator("chunks")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"chunks must be a power of two (1, 2, 4, ...), got {v}")
        return v

    @model_validator(mode="after")
    def _baseline_has_no_ring_fields(self) -> Decomposition:
        if self.method in ("baseline", "xla"):
            ring_fields = {
                name: getattr(self, name)
                for name in ("direction", "chunks", "unroll", "accumulate")
                if getattr(self, name) != type(self).model_fields[name].default
            }
            if ring_fields:
                raise ValueError(
                    f"method={self.method!r} takes no ring fields; remove {sorted(ring_fields)}"
                )
        if self.method == "xla" and self.fuse:
            raise ValueError("method='xla' is the product as written, left to XLA: it takes no fuse")
        return self

    @model_serializer(mode="wrap")
    def _omit_unfused(self, handler):
        data = handler(self)
        if not self.fuse:
            data.pop("fuse", None)
        return data

    @classmethod
    def baseline(cls, *, fuse: bool = False) -> Decomposition:
        """The collective followed by the einsum, as XLA would run it (``fuse``: see the class)."""
        return cls(method="baseline", fuse=fuse)

    @classmethod
    def xla(cls) -> Decomposition:
        """The product as written, left to XLA: GSPMD places the collective, and XLA's own windowed einsum
        decomposes it where the backend has one and the step is compiled with it on
        (`collective_matmul.planning.xla_options`)."""
        return cls(method="xla")

    @property
    def id(self) -> str:
        """The decomposition's key, e.g. ``ring-bi-c4-u2-f32`` or ``baseline-fuse``: one id per decomposition,
        read back by `from_id`.  A search trial is stored under it (``trials.decomposition_id``), and the
        API and the tables show it: a change of its format needs a migration of the stored ids."""
        suffix = "-fuse" if self.fuse else ""
        if self.method == "baseline":
            return "baseline" + suffix
        if self.method == "xla":
            return "xla"
        unroll = "full" if self.unroll == "full" else f"u{self.unroll}"
        acc = _SHORT[self.accumulate] if self.accumulate else "auto"
        return f"ring-{_SHORT[self.direction]}-c{self.chunks}-{unroll}-{acc}{suffix}"

    @classmethod
    def from_id(cls, text: str) -> Decomposition:
        """Parse the short id written by `id`."""
        fuse = text.endswith("-fuse")
        body = text.removesuffix("-fuse")
        if body == "baseline":
            return cls.baseline(fuse=fuse)
        if text == "xla":
            return cls.xla()
        parts = body.split("-")
        if len(parts) != 5 or parts[0] != "ring":
            raise ValueError(f"not a decomposition id: {text!r} (expected e.g. 'ring-uni-c2-full-dus')")
        long = {v: k for k, v in _SHORT.items()}
        try:
            direction = long[parts[1]]
            chunks = int(parts[2].removeprefix("c"))
            unroll: Unroll = "full" if parts[3] == "full" else int(parts[3].removeprefix("u"))  # type: ignore[assignment]
            accumulate = None if parts[4] == "auto" else long[parts[4]]
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a decomposition id: {text!r}") from exc
        return cls(direction=direction, chunks=chunks, unroll=unroll, accumulate=accumulate, fuse=fuse)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Decomposition:
        return cls.model_validate_json(text)

    def __str__(self) -> str:
        return self.id


# What plain autodiff of the baseline does for a weight gradient: keep the gathered operand of an
# all-gather matmul, gather dy once for both gradients of a matmul reduce-scatter.
DEFAULT_GRAD_WEIGHT = Decomposition.baseline(fuse=True)


class OpConfigs(BaseModel):
    """The three configs of one op call: its forward and the two halves of its backward."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    forward: Decomposition = Decomposition.baseline()
    grad_input: Decomposition = Decomposition.baseline()
    grad_weight: Decomposition = DEFAULT_GRAD_WEIGHT

    @property
    def is_baseline(self) -> bool:
        """True if these are the defaults (what autodiff of the baseline does)."""
        return self == OpConfigs()

    @property
    def ids(self) -> str:
        """``forward / grad_input / grad_weight`` decomposition ids."""
        return f"{self.forward.id} / {self.grad_input.id} / {self.grad_weight.id}"
