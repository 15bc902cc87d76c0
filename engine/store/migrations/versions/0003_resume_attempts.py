"""Count resumes per journal entry (to quarantine), and reopen entries a resume had closed."""

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
