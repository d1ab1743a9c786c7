"""Schema migrations (Alembic), driven from code: `cmtune db upgrade`, and checks at start-up."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import cmtune.migrations as migrations
from cmtune.service.models import Base


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # the config file format interpolates "%": a URL's own (an encoded password, a socket path) is doubled
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["target_metadata"] = Base.metadata  # for autogenerate; migrations import nothing of ours
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as connection:
        cfg = alembic_config(engine)
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as connection:
        cfg = alembic_config(engine)
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision(engine: Engine) -> str:
    return ScriptDirectory.from_config(alembic_config(engine)).get_current_head()


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision(engine)
