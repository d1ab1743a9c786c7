"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 05:27:59.783559
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hardware",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("platform", sa.String(length=64), nullable=False),
        sa.Column("device_kind", sa.String(length=128), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("process_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hardware")),
        sa.UniqueConstraint("key", name=op.f("uq_hardware_key")),
    )
    op.create_table(
        "problems",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("collective", sa.String(length=32), nullable=False),
        sa.Column("m", sa.Integer(), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("axis_size", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_problems")),
        sa.UniqueConstraint("key", name=op.f("uq_problems_key")),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("hash", name=op.f("uq_tokens_hash")),
    )
    op.create_table(
        "studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("hardware_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("protocol", sa.JSON(), nullable=False),
        sa.Column("space_size", sa.Integer(), nullable=False),
        sa.Column("stop_reason", sa.String(length=64), nullable=True),
        sa.Column("message", sa.String(length=2000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["hardware_id"], ["hardware.id"], name=op.f("fk_studies_hardware_id_hardware")),
        sa.ForeignKeyConstraint(["problem_id"], ["problems.id"], name=op.f("fk_studies_problem_id_problems")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_studies")),
    )
    with op.batch_alter_table("studies", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_studies_hardware_id"), ["hardware_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_studies_problem_id"), ["problem_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_studies_state"), ["state"], unique=False)

    op.create_table(
        "submissions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.JSON(), nullable=False),
        sa.Column("mesh", sa.JSON(), nullable=False),
        sa.Column("hardware_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["hardware_id"], ["hardware.id"], name=op.f("fk_submissions_hardware_id_hardware")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_submissions")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("hardware_id", sa.Integer(), nullable=False),
        sa.Column("software", sa.JSON(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["hardware_id"], ["hardware.id"], name=op.f("fk_workers_hardware_id_hardware")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_workers_active"), ["active"], unique=False)

    op.create_table(
        "submission_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("submission_id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("roles", sa.JSON(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["problem_id"], ["problems.id"], name=op.f("fk_submission_studies_problem_id_problems")
        ),
        sa.ForeignKeyConstraint(
            ["study_id"], ["studies.id"], name=op.f("fk_submission_studies_study_id_studies"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["submission_id"],
            ["submissions.id"],
            name=op.f("fk_submission_studies_submission_id_submissions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_submission_studies")),
    )
    with op.batch_alter_table("submission_studies", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_submission_studies_submission_id"), ["submission_id"], unique=False)

    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("decompositions", sa.JSON(), nullable=False),
        sa.Column("decomposition_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=True),
        sa.Column("ratio", sa.Float(), nullable=True),
        sa.Column("measurements", sa.JSON(), nullable=True),
        sa.Column("message", sa.String(length=2000), nullable=True),
        sa.Column("worker_id", sa.Integer(), nullable=True),
        sa.Column("result_lease_id", sa.String(length=36), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["study_id"], ["studies.id"], name=op.f("fk_trials_study_id_studies"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_trials_worker_id_workers"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trials")),
        sa.UniqueConstraint("study_id", "number", name=op.f("uq_trials_study_id")),
    )
    with op.batch_alter_table("trials", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_trials_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_trials_study_id"), ["study_id"], unique=False)

    op.create_table(
        "tuned_configs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("hardware_id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("decomposition", sa.JSON(), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("baseline_s", sa.Double(), nullable=False),
        sa.Column("speedup", sa.Double(), nullable=False),
        sa.Column("speedup_iqr", sa.Double(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("invalid", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("space_size", sa.Integer(), nullable=False),
        sa.Column("software", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["hardware_id"], ["hardware.id"], name=op.f("fk_tuned_configs_hardware_id_hardware")),
        sa.ForeignKeyConstraint(["problem_id"], ["problems.id"], name=op.f("fk_tuned_configs_problem_id_problems")),
        sa.ForeignKeyConstraint(
            ["study_id"], ["studies.id"], name=op.f("fk_tuned_configs_study_id_studies"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuned_configs")),
        sa.UniqueConstraint("problem_id", "hardware_id", name=op.f("uq_tuned_configs_problem_id")),
    )
    with op.batch_alter_table("tuned_configs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tuned_configs_hardware_id"), ["hardware_id"], unique=False)

    op.create_table(
        "leases",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], name=op.f("fk_leases_trial_id_trials"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_leases_worker_id_workers"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_leases_active"), ["active"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_expires_at"), ["expires_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_leases_trial_id"), ["trial_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_leases_trial_id"))
        batch_op.drop_index(batch_op.f("ix_leases_expires_at"))
        batch_op.drop_index(batch_op.f("ix_leases_active"))

    op.drop_table("leases")
    with op.batch_alter_table("tuned_configs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tuned_configs_hardware_id"))

    op.drop_table("tuned_configs")
    with op.batch_alter_table("trials", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_trials_study_id"))
        batch_op.drop_index(batch_op.f("ix_trials_state"))

    op.drop_table("trials")
    with op.batch_alter_table("submission_studies", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_submission_studies_submission_id"))

    op.drop_table("submission_studies")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workers_active"))

    op.drop_table("workers")
    op.drop_table("submissions")
    with op.batch_alter_table("studies", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_studies_state"))
        batch_op.drop_index(batch_op.f("ix_studies_problem_id"))
        batch_op.drop_index(batch_op.f("ix_studies_hardware_id"))

    op.drop_table("studies")
    op.drop_table("tokens")
    op.drop_table("problems")
    op.drop_table("hardware")
