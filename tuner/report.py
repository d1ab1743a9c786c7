"""Human-readable tables of measurements (rich)."""

from __future__ import annotations

from rich.table import Table

from collective_matmul.wire import Measurement


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def speedup_text(m: Measurement) -> str:
    """``1.23x ±0.05`` : baseline/candidate from the median paired ratio, and its IQR."""
    if not m.ok or m.ratio is None:
        return "-"
    return f"{1 / m.ratio:.2f}x ±{m.speedup_iqr / 2:.2f}"


def sweep_table(results: list[Measurement], *, title: str) -> Table:
    table = Table(title=title)
    for name, justify in [
        ("decomposition", "left"), ("status", "left"), ("median", "right"), ("IQR", "right"),
        ("baseline", "right"), ("speedup (IQR)", "right"), ("compile", "right"), ("memory", "right"),
    ]:
        table.add_column(name, justify=justify)
    ranked = sorted(results, key=lambda m: (not m.ok, m.ratio or float("inf")))
    for m in ranked:
        table.add_row(
            m.decomposition.id,
            m.status if m.ok else f"[red]{m.status}[/red]",
            fmt_seconds(m.candidate.median_s if m.candidate else None),
            fmt_seconds(m.candidate.iqr_s if m.candidate else None),
            fmt_seconds(m.baseline.median_s if m.baseline else None),
            speedup_text(m),
            fmt_seconds(m.compile_s),
            f"{m.memory_bytes / 2**20:.1f} MiB" if m.memory_bytes else "-",
        )
    return table


def tune_table(outcomes, *, title: str) -> Table:
    """One row per study of `cmtune tune`: the tuned decomposition and its evidence."""
    table = Table(title=title)
    for name, justify in [
        ("problem", "left"), ("best decomposition", "left"), ("time", "right"), ("baseline", "right"),
        ("speedup (IQR)", "right"), ("trials", "right"), ("invalid/failed", "right"), ("stopped by", "left"),
    ]:
        table.add_column(name, justify=justify)
    for o in outcomes:
        t = o.tuned
        table.add_row(
            o.study.problem.key, t.decomposition.id if t else f"[red]{o.study.state}[/red]",
            fmt_seconds(t.time_s if t else None), fmt_seconds(t.baseline_s if t else None),
            f"{t.speedup:.2f}x ±{t.speedup_iqr / 2:.2f}" if t else "-",
            f"{len(o.search)} of {o.study.space_size}",
            f"{t.invalid}/{t.failed}" if t else "-", o.study.stop_reason or "-",
        )
    return table
