"""step studies and per-model, per-role overrides

- studies.kind ('search' or 'step'), studies.step (what a step study measures: the block, the
  mesh, the search studies it waits for), studies.submission_id (the model it measures);
  studies.problem_id becomes optional (a step study has no one problem).
- trials.kind may be 'step'.
- role_overrides: what one role of one model runs on one hardware when the step measurement
  found it faster set back to the baseline (or with its weight gradient fused), and why.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=False, server_default="search"))
        batch.add_column(sa.Column("step", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("submission_id", sa.Integer(), nullable=True))
        batch.alter_column("problem_id", existing_type=sa.Integer(), nullable=True)
        batch.create_check_constraint(op.f("ck_studies_study_kind"), "kind IN ('search', 'step')")
        batch.create_foreign_key(op.f("fk_studies_submission_id_submissions"), "submissions", ["submission_id"],
                                 ["id"], ondelete="SET NULL")
    with op.batch_alter_table("trials") as batch:
        batch.drop_constraint(op.f("ck_trials_trial_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_trials_trial_kind"), "kind IN ('search', 'confirm', 'step')")
    op.create_table(
        "role_overrides",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("hardware_id", sa.Integer(), nullable=False),
        sa.Column("configs", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=2000), nullable=False),
        sa.Column("step_speedup", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["hardware_id"], ["hardware.id"], name=op.f("fk_role_overrides_hardware_id_hardware")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_role_overrides")),
        sa.UniqueConstraint("model", "role", "hardware_id", name=op.f("uq_role_overrides_model")),
    )


def downgrade() -> None:
    op.drop_table("role_overrides")
    op.execute("DELETE FROM trials WHERE kind = 'step'")
    with op.batch_alter_table("trials") as batch:
        batch.drop_constraint(op.f("ck_trials_trial_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_trials_trial_kind"), "kind IN ('search', 'confirm')")
    op.execute("DELETE FROM studies WHERE kind = 'step'")
    with op.batch_alter_table("studies") as batch:
        batch.drop_constraint(op.f("fk_studies_submission_id_submissions"), type_="foreignkey")
        batch.drop_constraint(op.f("ck_studies_study_kind"), type_="check")
        batch.alter_column("problem_id", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("submission_id")
        batch.drop_column("step")
        batch.drop_column("kind")
