"""Each traced request names the estimate its budget_score divides by."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("traced_requests", sa.Column("estimate", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("traced_requests") as batch:
        batch.drop_column("estimate")
