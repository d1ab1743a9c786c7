"""per-worker credentials and device memory

- workers.credential_hash: the SHA-256 of the credential registration hands a worker; every
  later call of that worker carries it, so a worker token shared by a fleet cannot act as
  another worker.  Workers registered before this revision have none and must register again.
- workers.memory_bytes: the memory of one of the worker's devices, as it reports it; submissions
  whose inputs cannot fit the hardware's workers are refused.

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("credential_hash", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("memory_bytes")
        batch.drop_column("credential_hash")
