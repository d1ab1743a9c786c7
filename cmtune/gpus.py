"""`cmtune gpu-card list|save`: the GPU cards a compile-only run (``--devices gpu:CARD:HxD``) can target."""

from __future__ import annotations

from typing import Annotated

import typer

from cmtune.common import console

app = typer.Typer(no_args_is_help=True)
card_app = typer.Typer(no_args_is_help=True, help="GPU cards for compiles without a GPU (--devices gpu:CARD:HxD).")
app.add_typer(card_app, name="gpu-card")


@card_app.command("list")
def list_cards() -> None:
    """The cards cmtune knows and where each one's target config comes from here."""
    from rich.table import Table

    from collective_matmul.programs.gpus import CARDS, GpuError, card_dir, embedded_kinds

    try:
        embedded = set(embedded_kinds())
    except GpuError as exc:
        console.print(f"[yellow]{exc}[/yellow]")
        embedded = set()
    table = Table(title=f"GPU cards (card files in {card_dir()})")
    for column in ("card", "device kind", "config"):
        table.add_column(column)
    saved = sorted(p.stem for p in card_dir().glob("*.topology")) if card_dir().is_dir() else []
    for name in saved:
        table.add_row(name, "", "card file (cmtune gpu-card save)")
    for card in CARDS.values():
        if card.name not in saved:
            source = "the installed CUDA plugin" if card.device_kind in embedded else "[red]none here[/red]"
            table.add_row(card.name, card.device_kind, source)
    console.print(table)


@card_app.command("save")
def save(name: Annotated[str, typer.Argument(help="the card's name in --devices gpu:NAME:HxD, e.g. h100-nvl")]) -> None:
    """Write a card file from this host's GPUs (run it where the card is), for compiles on any host."""
    from collective_matmul.programs.gpus import GpuError, save_card

    try:
        path = save_card(name)
    except GpuError as exc:
        raise typer.BadParameter(str(exc), param_hint="NAME") from None
    console.print(f"wrote {path}: compile for it anywhere with --devices gpu:{name}:HxD (copy the file to "
                  "$CMTUNE_GPU_CARDS or ~/.config/cmtune/gpus there)")
