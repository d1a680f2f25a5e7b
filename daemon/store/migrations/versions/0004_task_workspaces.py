"""The host paths of a task's workspace, recorded when kandev creates it (Issue 19 item 1): the
workspace, and for a git worktree its repository, git directory and administrative directory.

Tasks created before this revision have no row: kandev then removes a workspace it created as a
plain directory (never through git) and binds no git directory for it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_workspaces",
        sa.Column("task_id", sa.String(32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("owner_uid", sa.Integer(), nullable=False),
        sa.Column("created", sa.Boolean(), nullable=False),
        sa.Column("repository", sa.Text(), nullable=True),
        sa.Column("git_common_dir", sa.Text(), nullable=True),
        sa.Column("git_admin_dir", sa.Text(), nullable=True),
        sa.Column("git_owner_uid", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_task_workspaces")),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_task_workspaces_task_id_tasks"), ondelete="CASCADE"
        ),
    )


def downgrade() -> None:
    op.drop_table("task_workspaces")
