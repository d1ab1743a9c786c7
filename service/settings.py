"""Service settings: one pydantic-settings `Settings`, read from ``CMTUNE_*`` variables."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_database_url() -> str:
    """A SQLite file under the user's data directory (``$XDG_DATA_HOME/cmtune``)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{base / 'cmtune' / 'cmtune.sqlite'}"


class Settings(BaseSettings):
    """Everything the service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="CMTUNE_", extra="ignore")

    database_url: str = Field(default_factory=default_database_url)
    auth: Literal["token", "off"] = "token"
    lease_seconds: float = Field(default=120.0, gt=0, description="a lease lasts this long without a heartbeat")
    max_attempts: int = Field(default=3, ge=1, description="leases per trial before it fails")
    worker_offline_seconds: float = Field(default=60.0, gt=0)
    config_cache_seconds: float = Field(default=2.0, ge=0, description="how long a replica caches look-ups")
    token_cache_seconds: float = Field(default=5.0, ge=0, description="how long a replica trusts a token it "
                                       "has checked (a revocation takes effect within this time)")
    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="largest request body accepted")
    ready_proposals: int = Field(default=2, ge=1, le=32, description="search proposals the engine keeps "
                                 "queued per study, so that a lease is a claim, not an ask")
    request_threads: int = Field(default=4, ge=1, le=256, description="threads per server process that run "
                                 "the routes which wait on the database; a few keep the interpreter's lock "
                                 "from being passed around more than work gets done (see docs/benchmarks.md)")
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=1, le=65535)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    return Settings()
