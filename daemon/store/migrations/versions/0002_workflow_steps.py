"""Workflow steps of a task (docs/requirements.md#runtime-configuration-across-a-context-reset): named steps that may reset context and send a prompt on entry.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workflow_steps",
        sa.Column("task_id", sa.String(32), nullable=False),
        sa.Column("position", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("reset_context", sa.Boolean(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("entered_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("task_id", "position", name=op.f("pk_workflow_steps")),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_workflow_steps_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'active', 'blocked', 'done')", name=op.f("ck_workflow_steps_status")
        ),
    )


def downgrade() -> None:
    op.drop_table("workflow_steps")
