"""Initial store: journal, slow queries, calibrations, drift events, config changes."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "request_journal",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("tag", sa.String(128)),
        sa.Column("prompt_token_ids", sa.Text, nullable=False),
        sa.Column("sampling", sa.JSON, nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("prefilled_tokens", sa.Integer, nullable=False),
        sa.Column("chunks_done", sa.Integer, nullable=False),
        sa.Column("preemptions", sa.Integer, nullable=False),
        sa.Column("generated_token_ids", sa.Text, nullable=False),
        sa.Column("generated_tokens", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.Text),
        sa.Column("added_at", sa.Float, nullable=False),
        sa.Column("first_token_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("e2e_s", sa.Float),
        sa.Column("budget_score", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("resumed_at", sa.Float),
    )
    op.create_index("ix_request_journal_state", "request_journal", ["state"])

    op.create_table(
        "slow_queries",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("tag", sa.String(128)),
        sa.Column("budget_score", sa.Float, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("prefill_s", sa.Float, nullable=False),
        sa.Column("budgeted_s", sa.Float, nullable=False),
        sa.Column("chunks", sa.JSON, nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
    )
    op.create_index("ix_slow_queries_budget_score", "slow_queries", ["budget_score"])
    op.create_index("ix_slow_queries_tenant", "slow_queries", ["tenant"])

    op.create_table(
        "calibration_runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("info", sa.JSON, nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
    )
    op.create_table(
        "budget_tables",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "run_id",
            sa.Integer,
            sa.ForeignKey("calibration_runs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("context_tokens", sa.Integer, nullable=False),
        sa.Column("seconds", sa.Float, nullable=False),
    )
    op.create_index("ix_budget_tables_run_id", "budget_tables", ["run_id"])

    op.create_table(
        "drift_events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("deviation", sa.Float, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_table(
        "config_changes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("field", sa.String(128), nullable=False),
        sa.Column("old", sa.JSON),
        sa.Column("new", sa.JSON),
        sa.Column("source", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("config_changes")
    op.drop_table("drift_events")
    op.drop_index("ix_budget_tables_run_id", table_name="budget_tables")
    op.drop_table("budget_tables")
    op.drop_table("calibration_runs")
    op.drop_index("ix_slow_queries_tenant", table_name="slow_queries")
    op.drop_index("ix_slow_queries_budget_score", table_name="slow_queries")
    op.drop_table("slow_queries")
    op.drop_index("ix_request_journal_state", table_name="request_journal")
    op.drop_table("request_journal")
