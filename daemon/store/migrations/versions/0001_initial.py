"""Initial schema: tasks, sessions, turns, transcript, recovery inventory, control-server record,
credential leases, runtime update jobs.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SESSION_STATES = "'CREATED', 'STARTING', 'RUNNING', 'WAITING_FOR_INPUT', 'COMPLETED', 'FAILED', 'CANCELLED'"


def upgrade() -> None:
    op.create_table(
        "installation",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_installation")),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("workspace", sa.Text(), nullable=True),
        sa.Column("executor", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("interrupted", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
        sa.CheckConstraint("executor IN ('local', 'worktree')", name=op.f("ck_tasks_executor")),
        sa.CheckConstraint("state IN ('backlog', 'in_progress', 'review', 'done')", name=op.f("ck_tasks_state")),
    )
    op.create_table(
        "task_sessions",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("task_id", sa.String(32), nullable=False),
        sa.Column("agent", sa.String(64), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("metadata_json", sa.JSON(), nullable=False),
        sa.Column("passthrough", sa.Boolean(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_sessions")),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_task_sessions_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.CheckConstraint(f"state IN ({SESSION_STATES})", name=op.f("ck_task_sessions_state")),
    )
    op.create_index(
        op.f("ix_task_sessions_task_id_created_at"), "task_sessions", ["task_id", "created_at"]
    )
    op.create_table(
        "turns",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("stop_reason", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_turns")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["task_sessions.id"], name=op.f("fk_turns_session_id_task_sessions"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("session_id", "ordinal", name=op.f("uq_turns_session_id_ordinal")),
        sa.CheckConstraint("state IN ('open', 'finished', 'abandoned')", name=op.f("ck_turns_state")),
    )
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("turn_id", sa.String(128), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("instance_id", sa.String(128), nullable=True),
        sa.Column("event_seq", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_messages")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["task_sessions.id"], name=op.f("fk_messages_session_id_task_sessions"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("instance_id", "event_seq", name=op.f("uq_messages_instance_id_event_seq")),
        sa.CheckConstraint("role IN ('user', 'agent', 'system')", name=op.f("ck_messages_role")),
    )
    op.create_index(op.f("ix_messages_session_id"), "messages", ["session_id"])
    op.create_table(
        "executors_running",
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("task_id", sa.String(32), nullable=False),
        sa.Column("instance_id", sa.String(128), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("agent_pid", sa.Integer(), nullable=True),
        sa.Column("agent_pid_start_time", sa.Float(), nullable=True),
        sa.Column("resume_token", sa.Text(), nullable=True),
        sa.Column("worktree_path", sa.Text(), nullable=True),
        sa.Column("workspace_path", sa.Text(), nullable=False),
        sa.Column("runtime", sa.String(32), nullable=False),
        sa.Column("agent_profile", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("last_event_seq", sa.Integer(), nullable=False),
        sa.Column("created_by_boot", sa.String(64), nullable=False),
        sa.Column("metadata_json", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_executors_running")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["task_sessions.id"],
            name=op.f("fk_executors_running_session_id_task_sessions"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_executors_running_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.CheckConstraint("status IN ('live', 'stale')", name=op.f("ck_executors_running_status")),
    )
    op.create_table(
        "control_server_record",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("server_identity", sa.String(128), nullable=False),
        sa.Column("credential_ref", sa.String(128), nullable=False),
        sa.Column("capabilities", sa.JSON(), nullable=False),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pid_start_time", sa.Float(), nullable=True),
        sa.Column("launch_mode", sa.String(16), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_control_server_record")),
        sa.CheckConstraint("id = 1", name=op.f("ck_control_server_record_single_row")),
        sa.CheckConstraint(
            "launch_mode IN ('unit', 'detached', 'child')", name=op.f("ck_control_server_record_launch_mode")
        ),
    )
    op.create_table(
        "credential_leases",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("token_hash", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credential_leases")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["task_sessions.id"],
            name=op.f("fk_credential_leases_session_id_task_sessions"), ondelete="CASCADE",
        ),
        sa.UniqueConstraint("token_hash", name=op.f("uq_credential_leases_token_hash")),
    )
    op.create_index(op.f("ix_credential_leases_session_id"), "credential_leases", ["session_id"])
    op.create_table(
        "runtime_update_jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("agent", sa.String(64), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runtime_update_jobs")),
    )


def downgrade() -> None:
    for table in ("runtime_update_jobs", "credential_leases", "control_server_record", "executors_running",
                  "messages", "turns", "task_sessions", "tasks", "installation"):
        op.drop_table(table)
