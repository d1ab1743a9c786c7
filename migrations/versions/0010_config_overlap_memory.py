"""a tuned config keeps its compiled program's overlap verdict and memory

- tuned_configs.overlap: the winner's schedule verdict as the worker compiled it for the confirmation round
  (`collective_matmul.programs.schedule`: overlaps, partly, serialised, synchronous, no permutes); NULL: not recorded.
- tuned_configs.memory_bytes: the winner's compiled memory per device (`Compiled.memory_analysis()`); NULL:
  not recorded.

Rows stored before have neither (their confirmation measurements are in the trials, but a config can come
from a bundle, which had none before version 4).  Downgrading drops both columns.

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        batch.add_column(sa.Column("overlap", sa.String(16), nullable=True))
        batch.add_column(sa.Column("memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_column("memory_bytes")
        batch.drop_column("overlap")
