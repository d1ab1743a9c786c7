"""`cmtune serve | token | db`: the service's commands.

Module-level imports stay light (Typer and the command lines' shared console) so that `cmtune --help`
works on a worker host that does not have the service's dependencies.
"""

from __future__ import annotations

from typing import Annotated

import typer

from cmtune.common import console

app = typer.Typer(no_args_is_help=True)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ROLES = ("admin", "worker", "reader")


def _database():
    from cmtune.service.db import Database
    from cmtune.service.settings import get_settings

    return Database(get_settings().database_url)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="listen address (default CMTUNE_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default CMTUNE_PORT or 8470)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="server processes (uvicorn workers)")] = 1,
) -> None:
    """Run the service (uvicorn).  Upgrades an embedded SQLite schema; checks a PostgreSQL one."""
    import uvicorn

    from cmtune.service.db import Database
    from cmtune.service.main import SchemaOutOfDate, prepare_database
    from cmtune.service.settings import get_settings

    settings = get_settings()
    host = host or settings.host
    port = port or settings.port
    if settings.auth == "off" and host not in LOOPBACK:
        raise typer.BadParameter(f"refusing to listen on {host} with CMTUNE_AUTH=off: "
                                 "turn auth on or listen on 127.0.0.1", param_hint="--host")
    db = Database(settings.database_url)
    try:
        prepare_database(db)  # once, before any server process starts
    except SchemaOutOfDate as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    finally:
        db.dispose()
    uvicorn.run("cmtune.service.main:serve_app", factory=True, host=host, port=port, workers=workers,
                log_level="info", access_log=False)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Upgrade the schema of CMTUNE_DATABASE_URL (default: the embedded SQLite file)."""
    from cmtune.service import migrate

    db = _database()
    migrate.upgrade(db.engine, revision)
    console.print(f"schema at {migrate.current_revision(db.engine)} ({db.engine.url.render_as_string()})")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="target revision, e.g. base")]) -> None:
    """Downgrade the schema (``base`` drops every table)."""
    from cmtune.service import migrate

    db = _database()
    migrate.downgrade(db.engine, revision)
    console.print(f"schema at {migrate.current_revision(db.engine) or 'base'}")


@db_app.command("current")
def db_current() -> None:
    """Print the schema revision and whether it is current."""
    from cmtune.service import migrate

    db = _database()
    current, head = migrate.current_revision(db.engine), migrate.head_revision(db.engine)
    console.print(f"{current or 'empty'} (head {head}){'' if current == head else ': run cmtune db upgrade'}")


@db_app.command("wait")
def db_wait(timeout: Annotated[float, typer.Option(help="seconds to keep trying")] = 60.0) -> None:
    """Wait until the database accepts connections (for containers that start together)."""
    import time

    from sqlalchemy import text

    db = _database()
    deadline = time.monotonic() + timeout
    while True:
        try:
            with db.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            console.print("database is up")
            return
        except Exception as exc:  # noqa: BLE001 - any failure means: not yet
            if time.monotonic() > deadline:
                console.print(f"[red]database not reachable after {timeout:.0f}s: {exc}[/red]")
                raise typer.Exit(1) from None
            time.sleep(1)


def _store():
    from cmtune.service import migrate
    from cmtune.service.store import SqlStore

    db = _database()
    if db.engine.dialect.name == "sqlite":
        migrate.upgrade(db.engine)
    return SqlStore(db)


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="admin, worker or reader")],
    name: Annotated[str, typer.Option(help="what the token is for")] = "cli",
    value: Annotated[str | None, typer.Option(
        envvar="CMTUNE_NEW_TOKEN", help="store this token (e.g. from a secret) instead of a random one")] = None,
) -> None:
    """Create a token and print it (only its hash is stored); an existing ``--value`` is kept."""
    from cmtune.service.models import TokenRole

    if role not in ROLES:
        raise typer.BadParameter(f"{role!r}: expected admin, worker or reader", param_hint="--role")
    if value is not None and len(value) < 24:
        raise typer.BadParameter("a token must have at least 24 characters", param_hint="--value")
    with _store().write() as tx:
        if value is not None and tx.tokens.find(value) is not None:
            console.print(f"token {name!r} already exists", style="dim")
            return
        _, plain = tx.tokens.add(name=name, role=TokenRole(role), value=value)
    print(plain)


@token_app.command("list")
def token_list() -> None:
    """Every token: id, name, role, created, revoked (never the token itself)."""
    from rich.table import Table

    with _store().read() as tx:
        found = tx.tokens.all()
    table = Table(title=f"{len(found)} tokens")
    for column in ("id", "name", "role", "created", "revoked"):
        table.add_column(column)
    for t in found:
        table.add_row(str(t.id), t.name, t.role, t.created_at.isoformat(timespec="seconds"),
                      "[red]revoked[/red]" if t.revoked else "")
    console.print(table)


@token_app.command("revoke")
def token_revoke(token_id: Annotated[int, typer.Argument(help="the id from 'cmtune token list'")]) -> None:
    """Revoke a token: every server process refuses it within CMTUNE_TOKEN_CACHE_SECONDS (5 s)."""
    from cmtune.tuner.errors import NotFoundError

    try:
        with _store().write() as tx:
            revoked = tx.tokens.revoke(token_id)
    except NotFoundError as exc:
        console.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(1) from None
    console.print(f"revoked token {revoked.id} ({revoked.name}, {revoked.role})")
