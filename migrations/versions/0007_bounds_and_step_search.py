"""bounds with every tuned config; a step search's variants with every step trial

- tuned_configs.compute_s / communication_s / bounds_baseline_s: the medians of the local matmul alone,
  the collective alone and the baseline, timed together in the confirmation round's bounds rounds
  (`collective_matmul.wire.bounds`).  NULL for configs tuned before this revision, or whose round timed
  no bounds.
- trials.bounds: a confirmation trial's bounds measurement (`collective_matmul.wire.BoundsMeasurement`).
- trials.variants: a step trial's variants by name, each its per-role configs (the step search asks
  for different variants each round); NULL for step trials before this revision (their variants are
  the standard menu of their flat configs, as before).

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        batch.add_column(sa.Column("compute_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("communication_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("bounds_baseline_s", sa.Float(), nullable=True))
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("bounds", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("variants", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("variants")
        batch.drop_column("bounds")
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_column("bounds_baseline_s")
        batch.drop_column("communication_s")
        batch.drop_column("compute_s")
