"""software stacks: tuned configs keyed by the stack that measured them, and re-confirmation studies

- tuned_configs.software_key: the key of the software stack that measured the config
  (`collective_matmul.planning.problem.Software.key`); the unique constraint becomes (problem_id, hardware_id,
  software_key), so a config measured on a new stack is a row of its own and the old stack's stays.
  Existing rows get the key of their stored jax and jaxlib versions with an empty platform version
  and an empty flags digest (`_software_key` computes it as `Software.key` does): they were recorded
  before the flags and the platform version were.  A running stack always reports a platform version
  (``cpu`` on CPU), so a look-up that names its stack answers these rows ``stale`` until they are
  re-confirmed on it, which the first worker to register with that stack queues (one confirmation
  round per config); a look-up that names no stack is answered from them as before.
- role_overrides.software: the stack of the step measurement that decided an override (NULL for
  overrides decided before this revision).
- studies.software / studies.software_key: the stack a study's trials must run on (only workers of
  that stack lease them; NULL: any worker of the hardware, as before); studies.reconfirm: what a
  re-confirmation study re-times (`collective_matmul.wire.Reconfirmation`).

Downgrading keeps, of each (problem, hardware), only its newest config (the old unique constraint
allows one); re-confirmation studies stay, as plain studies in their confirmation round.

Revision ID: 0008
Revises: 0007
"""

import hashlib
import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_tuned = sa.table("tuned_configs", sa.column("id", sa.Integer()), sa.column("problem_id", sa.Integer()),
                  sa.column("hardware_id", sa.Integer()), sa.column("software", sa.JSON()),
                  sa.column("software_key", sa.String(64)), sa.column("updated_at", sa.DateTime(timezone=True)))


def _software_key(stored: dict | None) -> str:
    """`Software.key` of a stored config's versions (no platform version, no flags): 16 hex digits of the
    SHA-256 of the canonical JSON of the four fields."""
    stored = stored or {}
    fields = {"flags": "", "jax": str(stored.get("jax") or ""), "jaxlib": str(stored.get("jaxlib") or ""),
              "platform_version": ""}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def upgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        batch.add_column(sa.Column("software_key", sa.String(length=64), nullable=True))
    bind = op.get_bind()
    for row in bind.execute(sa.select(_tuned.c.id, _tuned.c.software)).all():
        stored = json.loads(row.software) if isinstance(row.software, str) else row.software
        bind.execute(_tuned.update().where(_tuned.c.id == row.id).values(software_key=_software_key(stored)))
    with op.batch_alter_table("tuned_configs") as batch:
        batch.alter_column("software_key", existing_type=sa.String(length=64), nullable=False)
        batch.drop_constraint(op.f("uq_tuned_configs_problem_id"), type_="unique")
        batch.create_unique_constraint(op.f("uq_tuned_configs_problem_id"),
                                       ["problem_id", "hardware_id", "software_key"])
    with op.batch_alter_table("role_overrides") as batch:
        batch.add_column(sa.Column("software", sa.JSON(), nullable=True))
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("software", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("software_key", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("reconfirm", sa.JSON(), nullable=True))
        batch.create_index(batch.f("ix_studies_software_key"), ["software_key"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.drop_index(batch.f("ix_studies_software_key"))
        batch.drop_column("reconfirm")
        batch.drop_column("software_key")
        batch.drop_column("software")
    with op.batch_alter_table("role_overrides") as batch:
        batch.drop_column("software")
    bind = op.get_bind()
    kept: dict[tuple[int, int], int] = {}
    for row in bind.execute(sa.select(_tuned.c.id, _tuned.c.problem_id, _tuned.c.hardware_id)
                            .order_by(_tuned.c.updated_at, _tuned.c.id)).all():
        older = kept.get((row.problem_id, row.hardware_id))
        if older is not None:
            bind.execute(_tuned.delete().where(_tuned.c.id == older))
        kept[row.problem_id, row.hardware_id] = row.id
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_constraint(op.f("uq_tuned_configs_problem_id"), type_="unique")
        batch.create_unique_constraint(op.f("uq_tuned_configs_problem_id"), ["problem_id", "hardware_id"])
        batch.drop_column("software_key")
