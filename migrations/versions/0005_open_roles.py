"""open role labels: a user's projections, not only the reference block's four

- role_overrides.role widens from 16 to 200 characters (a Flax module path, a named scope, or a
  source location: `collective_matmul.programs.roles`).
- role_overrides.problems: the role's forward / grad_input / grad_weight problems, so that an
  override of a user's step (imported from `cmtune verify --step --decide`) is checked against
  them; NULL for overrides stored before this revision.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("role_overrides") as batch:
        batch.alter_column("role", existing_type=sa.String(length=16), type_=sa.String(length=200),
                           existing_nullable=False)
        batch.add_column(sa.Column("problems", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM role_overrides WHERE length(role) > 16")
    with op.batch_alter_table("role_overrides") as batch:
        batch.drop_column("problems")
        batch.alter_column("role", existing_type=sa.String(length=200), type_=sa.String(length=16),
                           existing_nullable=False)
