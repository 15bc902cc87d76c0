"""Calibration runs record why they ran: the first calibration at start, drift that
persisted, or an operator's request (issue 16).

Revision ID: 0004
Revises: 0003 (chained after Q2's timeline revision; 0003 revises E's 0002 once merged)
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calibration_runs") as batch:
        batch.add_column(sa.Column("reason", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("calibration_runs") as batch:
        batch.drop_column("reason")
