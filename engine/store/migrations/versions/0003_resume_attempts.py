"""The journal counts how often each request was handed to a new run (resume_attempts), so a
request that kills the process while it is resumed can be quarantined instead of resumed
forever. Entries a resume had closed (state RESUMED) but never re-added are opened again:
that state lost them when the resumed run died before re-adding them (issue 15, finding 14).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("request_journal", sa.Column("resume_attempts", sa.Integer, nullable=False,
                                             server_default="0"))
    op.execute("UPDATE request_journal SET state = 'WAITING', resume_attempts = 1 "
               "WHERE state = 'RESUMED'")


def downgrade() -> None:
    with op.batch_alter_table("request_journal") as batch:
        batch.drop_column("resume_attempts")
