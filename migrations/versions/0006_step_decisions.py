"""a step study's decision as a typed record

- studies.decision: what the step measurement decided (`collective_matmul.wire.StepChoice`: the variant
  that runs, its speedups against the step as written and the all-baseline step, the time it saves,
  the roles it overrides and why), written by the engine when the step study completes and served
  as stored.  NULL for search studies, and for step studies completed before this revision (their
  decision is then read back from the step trial's measurement, as before).

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("decision", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.drop_column("decision")
