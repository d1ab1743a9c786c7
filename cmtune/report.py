"""Human-readable tables of measurements (rich)."""

from __future__ import annotations

from rich.table import Table

from collective_matmul.planning.models import slot_label
from collective_matmul.wire import BoundsMeasurement, Measurement
from collective_matmul.wire.bounds import Bounds, hidden_fraction


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_fraction(fraction: float | None) -> str:
    """A hidden fraction as a percentage ("-": nothing to hide, or no bounds)."""
    return "-" if fraction is None else f"{fraction:.0%}"


def bounds_of(record: BoundsMeasurement | None) -> Bounds | None:
    """The medians of an ``ok`` bounds measurement (None otherwise)."""
    if record is None or not record.ok:
        return None
    return Bounds(record.compute.median_s, record.communication.median_s, record.baseline.median_s)


def bounds_caption(record: BoundsMeasurement | None) -> str:
    """One line: the bounds rounds' medians and the bound, or why there are none."""
    if record is None:
        return "no bounds measured"
    b = bounds_of(record)
    if b is None:
        return f"bounds: {record.status} {record.message[:200]}"
    return (f"bounds: compute {fmt_seconds(b.compute_s)}, communication {fmt_seconds(b.communication_s)}, bound "
            f"{fmt_seconds(b.bound_s)}, against a baseline of {fmt_seconds(b.baseline_s)} in the same rounds")


def speedup_text(m: Measurement) -> str:
    """``1.23x ±0.05`` : baseline/candidate from the median paired ratio, and its IQR."""
    if not m.ok or m.ratio is None:
        return "-"
    return f"{1 / m.ratio:.2f}x ±{m.speedup_iqr / 2:.2f}"


def sweep_table(results: list[Measurement], *, title: str, bounds: BoundsMeasurement | None = None) -> Table:
    """Every candidate timed against the baseline; with the problem's ``bounds``, each ring's hidden fraction
    (`collective_matmul.wire.bounds`) and the bounds in the caption."""
    table = Table(title=title, caption=bounds_caption(bounds), caption_justify="left")
    for name, justify in [
        ("decomposition", "left"), ("status", "left"), ("median", "right"), ("IQR", "right"),
        ("baseline", "right"), ("speedup (IQR)", "right"), ("hidden", "right"), ("compile", "right"),
        ("memory", "right"),
    ]:
        table.add_column(name, justify=justify)
    b = bounds_of(bounds)
    ranked = sorted(results, key=lambda m: (not m.ok, m.ratio or float("inf")))
    for m in ranked:
        ring = m.decomposition.method == "ring"
        table.add_row(
            m.decomposition.id,
            m.status if m.ok else f"[red]{m.status}[/red]",
            fmt_seconds(m.candidate.median_s if m.candidate else None),
            fmt_seconds(m.candidate.iqr_s if m.candidate else None),
            fmt_seconds(m.baseline.median_s if m.baseline else None),
            speedup_text(m),
            fmt_fraction(hidden_fraction(b, m.ratio, ring=True)) if ring and m.ok else "-",
            fmt_seconds(m.compile_s),
            f"{m.memory_bytes / 2**20:.1f} MiB" if m.memory_bytes else "-",
        )
    return table


def tune_table(outcomes, *, title: str) -> Table:
    """One row per study of `cmtune tune`: the tuned decomposition and its evidence, its bounds (compute,
    communication, the bound, the hidden fraction) and, in the caption, each problem's reason."""
    table = Table(title=title, caption_justify="left")
    for name, justify in [
        ("problem", "left"), ("best decomposition", "left"), ("time", "right"), ("baseline", "right"),
        ("speedup (IQR)", "right"), ("compute", "right"), ("communication", "right"), ("bound", "right"),
        ("hidden", "right"), ("trials", "right"), ("invalid/failed", "right"), ("stopped by", "left"),
        ("seeded from", "left"),
    ]:
        table.add_column(name, justify=justify)
    reasons = []
    for o in outcomes:
        t = o.tuned
        neighbours = list(dict.fromkeys(s.neighbour.split(":")[1] for s in o.study.settings.seeds))
        table.add_row(
            o.study.problem.key, t.decomposition.id if t else f"[red]{o.study.state}[/red]",
            fmt_seconds(t.time_s if t else None), fmt_seconds(t.baseline_s if t else None),
            f"{t.speedup:.2f}x ±{t.speedup_iqr / 2:.2f}" if t else "-",
            fmt_seconds(t.compute_s if t else None), fmt_seconds(t.communication_s if t else None),
            fmt_seconds(t.bound_s if t else None), fmt_fraction(t.hidden_fraction if t else None),
            f"{len(o.search)} of {o.study.space_size}",
            f"{t.invalid}/{t.failed}" if t else "-", o.study.stop_reason or "-",
            ", ".join(neighbours) or "-",
        )
        if t is not None:
            reasons.append(f"{o.study.problem.key}: {t.reason}")
        if o.study.settings.screen:
            reasons.append(f"{o.study.problem.key}: {screen_summary(o.study.settings.screen)}")
    table.caption = "\n".join(reasons) or None
    return table


def screen_summary(screen, *, named: int = 6) -> str:
    """A compile screen in one line: how many forms overlap (timed first), then the others by verdict, each form
    named where there are at most ``named`` of them."""
    from collections import Counter

    overlapping = sum(s.overlap == "overlaps" for s in screen)
    others = [s for s in screen if s.overlap not in ("overlaps", "no permutes")]
    text = f"compile screen: {overlapping} of {len(screen)} forms overlap, timed first"
    if not others:
        return text
    if len(others) <= named:
        return text + "; after them: " + ", ".join(f"{s.decomposition.id} ({s.overlap or 'did not compile'})"
                                                   for s in others)
    counts = Counter(s.overlap or "did not compile" for s in others)
    return text + "; after them: " + ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common())


def step_table(measurement, *, title: str) -> Table:
    """One row per variant of a step measurement (`cmtune.workers.step.StepMeasurement`)."""
    table = Table(title=title)
    for name, justify in [
        ("variant", "left"), ("status", "left"), ("median step", "right"), ("IQR", "right"), ("runs", "right"),
        (f"speedup vs {measurement.reference} (IQR)", "right"), ("rel. error", "right"), ("compile", "right"),
        ("memory", "right"),
    ]:
        table.add_column(name, justify=justify)
    for v in measurement.variants:
        if v.name == measurement.reference:
            speedup = "1.00x (reference)" if v.ok else "-"
        else:
            speedup = f"{v.speedup:.2f}x ±{v.speedup_iqr / 2:.2f}" if v.ok and v.ratio else "-"
        table.add_row(
            v.name,
            v.status if v.ok else f"[red]{v.status}[/red]",
            fmt_seconds(v.timing.median_s if v.timing else None),
            fmt_seconds(v.timing.iqr_s if v.timing else None),
            str(len(v.timing.samples_s)) if v.timing else "-",
            speedup,
            f"{v.rel_error:.1e}" if v.rel_error is not None else "-",
            fmt_seconds(v.compile_s),
            f"{v.memory_bytes / 2**20:.1f} MiB" if v.memory_bytes else "-",
        )
    return table


def roles_table(resolved: dict, *, title: str) -> Table:
    """Per role and slot: the problem, the config used, and where it came from.

    ``resolved``: role -> slot -> `collective_matmul.wire.Resolved`.
    """
    table = Table(title=title)
    for name in ("role", "problem", "config", "from"):
        table.add_column(name)
    for role, slots in resolved.items():
        for slot, found in slots.items():
            table.add_row(slot_label(role, slot), found.problem, found.decomposition, f"{found.match} ({found.source})")
    return table


def discovery_tables(discovery, *, title: str) -> list[Table]:
    """The problems a step's discovery found (role, slot, runs per step) and what it skipped, and why."""
    found = Table(title=title)
    by_xla = any(p.xla for p in discovery.problems)
    for name, justify in [("role", "left"), ("slot", "left"), ("problem", "left"), ("per step", "right"),
                          ("axis", "left"), ("source", "left"), *([("XLA", "left")] if by_xla else [])]:
        found.add_column(name, justify=justify)
    for p in discovery.problems:
        found.add_row(p.role, p.slot, p.problem.key, str(p.count), p.axis or "-", p.source or "-",
                      *(["decomposes it itself" if p.xla else "-"] if by_xla else []))
    tables = [found] if discovery.problems else []
    if discovery.decomposed:
        loops = Table(title="collective matmuls XLA's own windowed einsum decomposes in the step as compiled (each "
                            "is a problem above too: tuned against XLA's choice)")
        for name in ("role", "loop", "problem", "per step"):
            loops.add_column(name)
        for d in discovery.decomposed:
            loops.add_row(d.role, d.what, d.problem or "-", str(d.count))
        tables.append(loops)
    if discovery.skipped:
        skipped = Table(title="collectives next to a dot that are not decomposed")
        for name in ("role", "what", "per step", "why"):
            skipped.add_column(name)
        for s in discovery.skipped:
            skipped.add_row(s.role, s.what, str(s.count), s.reason)
        tables.append(skipped)
    return tables


def seen_line(discovery) -> str:
    """What the module discovery read held (``Discovery.seen``), in words."""
    seen = dict(discovery.seen)
    products = seen.pop("products", 0)
    collectives = ", ".join(f"{count} {op}" for op, count in sorted(seen.items())) or "no collective"
    return (f"the compiled step runs {products} matrix product(s) and {collectives} per step"
            + ("" if seen else ": nothing to overlap (is the step's mesh more than one device, and its arguments "
                                "sharded?)"))


def sites_table(sites, *, title: str) -> Table:
    """Every call site a `Tuned` client traced: what it solved and ran there, or why it fell back (the caption: why
    any answer came from nothing measured)."""
    unmeasured = dict.fromkeys(note for site in sites if site.applied for note in site.unmeasured)
    table = Table(title=title, caption="; ".join(unmeasured) or None, caption_justify="left")
    for name in ("role", "source", "problem", "forward", "grad_input", "grad_weight"):
        table.add_column(name)
    for site in sites:
        if not site.applied:
            table.add_row(site.role, site.site, "[yellow]lax.dot_general[/yellow]", site.reason, "", "")
            continue
        if site.gathered_by:  # its product is local; its backward is the gathering call's
            table.add_row(site.role, site.site, site.problems["forward"].key,
                          f"[cyan]reuses {site.gathered_by}'s gather[/cyan]", "in its reduce-scatter", "local")
            continue
        if site.members:  # a group's summed input gradient: the gathering call's one reduce-scatter ring
            found = site.found["grad_input"]
            table.add_row(site.role, site.site, site.problems["grad_input"].key, "[cyan]the group's[/cyan]",
                          f"{found.decomposition.id} ({found.match})", "")
            continue
        cells = [f"{f.decomposition.id} ({f.match})" for f in (site.found[s] for s in
                                                              ("forward", "grad_input", "grad_weight"))]
        table.add_row(site.role, site.site, site.problems["forward"].key, *cells)
    return table


def compiled_table(results, *, title: str, predictions=None) -> Table:
    """Candidates compiled and never run: compile seconds, memory per device, the schedule's overlap verdict and,
    with ``predictions`` (one `collective_matmul.programs.predict.Prediction` or None per result), the time the
    compiled schedule predicts.  The first rows are the product as written (XLA's windowed einsum at its default,
    then off)."""
    caption = ("compiled, not timed: a verdict says whether a product is scheduled while each permute is in flight; "
               "measured times need the hardware")
    models = sorted({p.cost_model for p in predictions or () if p is not None})
    if models:
        caption += (f"; predicted: the compiled schedule replayed with published figures ({', '.join(models)}), "
                    "a prediction, not a measurement")
        if any(r.hardware.platform == "gpu" and r.xla_options.get("xla_gpu_multi_streamed_windowed_einsum") is False
               for r in results):
            caption += " (compiled without a GPU: XLA's windowed einsum on one stream, multi-streamed on a real node)"
    elif predictions is not None:
        caption += "; no predicted times: no cost-model figures for this device kind"
    table = Table(title=title, caption=caption)
    columns = [("program", "left"), ("status", "left"), ("compile", "right"), ("memory / device", "right"),
               ("overlap", "left")] + ([("predicted", "right")] if models else []) + [("why", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    predictions = list(predictions) if predictions is not None else [None] * len(results)
    from collective_matmul.planning.xla_options import windowed_einsum

    for r, predicted in zip(results, predictions, strict=True):
        name = r.decomposition.id
        off = windowed_einsum(r.hardware.platform, "off") or {}
        is_off = bool(off) and off.items() <= r.xla_options.items()
        if r.decomposition.method == "baseline" and (is_off or r is results[0]):
            name = f"as written (XLA windowed einsum {'off' if is_off else 'default'})"
        elif r.decomposition.method == "xla":
            name = "xla (the product as written, XLA's windowed einsum on)"
        colour = {"overlaps": "green", "serialised": "red", "partly": "yellow"}.get(r.overlap or "", "")
        verdict = f"[{colour}]{r.overlap}[/{colour}]" if colour else (r.overlap or "-")
        cells = [name, r.status, fmt_seconds(r.compile_s),
                 "-" if r.memory_bytes is None else f"{r.memory_bytes / 2**20:.1f} MiB", verdict]
        if models:
            hidden = predicted.overlapped_share if predicted is not None else None
            cells.append("-" if predicted is None else f"{fmt_seconds(predicted.seconds)} predicted"
                         + (f" ({hidden:.0%} overlapped)" if hidden is not None else ""))
        table.add_row(*cells, r.overlap_note if r.status == "compiled" else r.message[:200])
    return table


def compiled_steps_table(variants, *, title: str) -> Table:
    """Whole steps compiled and never run (`cmtune.workers.aot.CompiledVariant`s), each with its compiled
    schedule's predicted time where its device kind has figures."""
    from cmtune.tuner.variants import REFERENCE

    caption = ("compiled, not timed: memory per device, the collectives of the step and whether a product is "
               "scheduled while each permute is in flight")
    models = sorted({v.prediction.cost_model for v in variants if getattr(v, "prediction", None) is not None})
    if models:
        caption += (f"; predicted: the compiled schedule replayed with published figures ({', '.join(models)}), "
                    "a prediction, not a measurement")
    table = Table(title=title, caption=caption)
    columns = [("step", "left"), ("compile", "right"), ("memory / device", "right"), ("all-gathers", "right"),
               ("reduce-scatters", "right"), ("all-reduces", "right"), ("permutes", "right")]
    columns += [("predicted", "right")] if models else []
    for name, justify in columns + [("overlap", "left")]:
        table.add_column(name, justify=justify)
    for v in variants:
        name = "as written" if v.label == REFERENCE else v.label
        if v.windowed_einsum is not None:
            name += f" (XLA windowed einsum {v.windowed_einsum})"
        if v.error:
            table.add_row(name, "[red]failed[/red]", v.error, *[""] * (len(columns) - 2))
            continue
        cells = [name, fmt_seconds(v.compile_s), "-" if v.memory_bytes is None else
                 f"{v.memory_bytes / 2**20:.1f} MiB",
                 *(str(v.collectives[op]) for op in ("all-gather", "reduce-scatter", "all-reduce",
                                                     "collective-permute"))]
        if models:
            p = v.prediction
            cells.append("-" if p is None else f"{fmt_seconds(p.seconds)} predicted"
                         + (f", {len(p.unpriced)} unpriced" if p.unpriced else ""))
        table.add_row(*cells, v.overlap.summary() if v.overlap.windows else v.overlap.verdict)
    return table


def predicted_products_table(found, *, title: str) -> Table:
    """Each discovered product's programs predicted (``(roles, cmtune.workers.aot.ProductPrediction)`` pairs): as
    written, XLA's windowed einsum off and on, the ring predicted fastest."""
    models = sorted({got.cost_model for _, got in found})
    table = Table(title=title, caption=f"predicted ({', '.join(models)}): compiled schedules replayed with "
                                       "published figures, not measurements")
    for name, justify in (("roles", "left"), ("problem", "left"), ("as written", "right"),
                          ("windowed einsum off", "right"), ("windowed einsum on", "right"),
                          ("predicted best ring", "left"), ("its time", "right")):
        table.add_column(name, justify=justify)
    for roles, got in found:
        table.add_row(roles, got.problem.key, fmt_seconds(got.as_written_s), fmt_seconds(got.windowed_off_s),
                      fmt_seconds(got.windowed_einsum_s), got.best.id if got.best else "-", fmt_seconds(got.best_s))
    return table
