"""one study engine: states checked by the database, study progress columns, pending-trial index

- CHECK constraints on studies.state, trials.state/kind/status and tokens.role (the values of the
  Enums in collective_matmul.wire and service/models.py).
- Trials cancelled with their study were stored as state 'failed' + status 'cancelled'; they
  become state 'cancelled' (a trial state, not a measurement status).
- studies.trials_done / best_trial_id / best_ratio: progress kept by the engine with each
  result, back-filled from the trials.
- A partial index on pending trials for the lease claim.

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STUDY_STATES = ("pending", "running", "confirming", "completed", "failed", "cancelled")
TRIAL_STATES = ("pending", "leased", "completed", "failed", "cancelled")
TRIAL_KINDS = ("search", "confirm")
STATUSES = ("ok", "invalid", "compile_error", "oom", "timeout", "error")
ROLES = ("admin", "worker", "reader")


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.execute("UPDATE trials SET state = 'cancelled', status = NULL WHERE status = 'cancelled'")
    op.execute(f"UPDATE trials SET status = 'error' WHERE status IS NOT NULL AND NOT ({_in('status', STATUSES)})")
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("trials_done", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("best_trial_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("best_ratio", sa.Float(), nullable=True))
        batch.create_check_constraint(op.f("ck_studies_study_state"), _in("state", STUDY_STATES))
    with op.batch_alter_table("trials") as batch:
        batch.create_check_constraint(op.f("ck_trials_trial_state"), _in("state", TRIAL_STATES))
        batch.create_check_constraint(op.f("ck_trials_trial_kind"), _in("kind", TRIAL_KINDS))
        batch.create_check_constraint(op.f("ck_trials_trial_status"), _in("status", STATUSES))
    with op.batch_alter_table("tokens") as batch:
        batch.create_check_constraint(op.f("ck_tokens_token_role"), _in("role", ROLES))
    op.create_index("ix_trials_pending", "trials", ["study_id", "number"],
                    postgresql_where=sa.text("state = 'pending'"), sqlite_where=sa.text("state = 'pending'"))
    # back-fill the progress of existing studies from their finished search trials
    op.execute("""
        UPDATE studies SET trials_done = (
            SELECT COUNT(*) FROM trials t
            WHERE t.study_id = studies.id AND t.kind = 'search' AND t.state IN ('completed', 'failed'))
    """)
    op.execute("""
        UPDATE studies SET best_ratio = (
            SELECT MIN(t.ratio) FROM trials t
            WHERE t.study_id = studies.id AND t.kind = 'search' AND t.status = 'ok' AND t.ratio IS NOT NULL)
    """)
    op.execute("""
        UPDATE studies SET best_trial_id = (
            SELECT MIN(t.id) FROM trials t
            WHERE t.study_id = studies.id AND t.kind = 'search' AND t.status = 'ok' AND t.ratio = studies.best_ratio)
        WHERE best_ratio IS NOT NULL
    """)


def downgrade() -> None:
    op.drop_index("ix_trials_pending", table_name="trials")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint(op.f("ck_tokens_token_role"), type_="check")
    with op.batch_alter_table("trials") as batch:
        batch.drop_constraint(op.f("ck_trials_trial_status"), type_="check")
        batch.drop_constraint(op.f("ck_trials_trial_kind"), type_="check")
        batch.drop_constraint(op.f("ck_trials_trial_state"), type_="check")
    with op.batch_alter_table("studies") as batch:
        batch.drop_constraint(op.f("ck_studies_study_state"), type_="check")
        batch.drop_column("best_ratio")
        batch.drop_column("best_trial_id")
        batch.drop_column("trials_done")
    op.execute("UPDATE trials SET state = 'failed', status = 'cancelled' WHERE state = 'cancelled'")
