"""Every row names the server that wrote it; journal ids are unique per server."""

from __future__ import annotations

import socket

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TABLES = ("request_journal", "slow_queries", "traced_requests", "calibration_runs",
          "drift_events", "config_changes")
# SQLite's inline UNIQUE of 0001 has no name: batch mode finds it by this convention.
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}
POSTGRESQL_UNIQUE = "request_journal_request_id_key"


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("server", sa.String(256), nullable=False,
                                       server_default=""))
        op.execute(sa.text(f"UPDATE {table} SET server = :host").bindparams(
            host=socket.gethostname()))
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("request_journal", naming_convention=NAMING) as batch:
        batch.drop_constraint("uq_request_journal_request_id" if sqlite else POSTGRESQL_UNIQUE,
                              type_="unique")
        batch.create_unique_constraint("uq_request_journal_server_request_id",
                                       ["server", "request_id"])
    op.create_index("ix_request_journal_server_state", "request_journal", ["server", "state"])
    op.drop_index("ix_slow_queries_budget_score", table_name="slow_queries")
    op.create_index("ix_slow_queries_budget_score", "slow_queries", ["budget_score", "id"])
    op.create_index("ix_slow_queries_created_at", "slow_queries", ["created_at", "id"])
    op.create_index("ix_slow_queries_prompt_tokens", "slow_queries", ["prompt_tokens", "id"])
    op.create_index("ix_slow_queries_prefill_s", "slow_queries", ["prefill_s", "id"])
    op.create_index("ix_slow_queries_server_budget_score", "slow_queries",
                    ["server", "budget_score", "id"])
    op.create_index("ix_slow_queries_server_created_at", "slow_queries",
                    ["server", "created_at", "id"])
    op.create_index("ix_calibration_runs_model_device", "calibration_runs", ["model", "device"])
    op.create_index("ix_drift_events_server", "drift_events", ["server", "id"])


def downgrade() -> None:
    op.drop_index("ix_drift_events_server", table_name="drift_events")
    op.drop_index("ix_calibration_runs_model_device", table_name="calibration_runs")
    op.drop_index("ix_slow_queries_server_created_at", table_name="slow_queries")
    op.drop_index("ix_slow_queries_server_budget_score", table_name="slow_queries")
    op.drop_index("ix_slow_queries_prefill_s", table_name="slow_queries")
    op.drop_index("ix_slow_queries_prompt_tokens", table_name="slow_queries")
    op.drop_index("ix_slow_queries_created_at", table_name="slow_queries")
    op.drop_index("ix_slow_queries_budget_score", table_name="slow_queries")
    op.create_index("ix_slow_queries_budget_score", "slow_queries", ["budget_score"])
    op.drop_index("ix_request_journal_server_state", table_name="request_journal")
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("request_journal", naming_convention=NAMING) as batch:
        batch.drop_constraint("uq_request_journal_server_request_id", type_="unique")
        batch.create_unique_constraint(
            "uq_request_journal_request_id" if sqlite else POSTGRESQL_UNIQUE, ["request_id"])
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("server")
