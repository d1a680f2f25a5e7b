"""Several hosts on one PostgreSQL (Issue 47): each session records the host whose backend drives
it (``task_sessions.host``; NULL on a single-host store), so does a runtime update job (each host
prepares its own runtimes: ``runtime_update_jobs.host``), the cluster's hosts have a table of their
own (``cluster_hosts``: who claimed each name, its heartbeat, its clean stop), and the
control-server record becomes one per host (``host``, unique; ``""`` on a single-host store, whose
record stays the one row ``id = 1``). A single-host store (SQLite or PostgreSQL) migrates as it is.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("task_sessions", "runtime_update_jobs"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("host", sa.String(64), nullable=True))
    op.create_table(
        "cluster_hosts",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("installation_id", sa.String(64), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("machine", sa.Text(), nullable=False),
        sa.Column("version", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_cluster_hosts")),
    )
    with op.batch_alter_table("control_server_record") as batch:
        batch.add_column(sa.Column("host", sa.String(64), nullable=False, server_default=""))
        batch.drop_constraint(op.f("ck_control_server_record_single_row"), type_="check")
        batch.create_check_constraint(op.f("ck_control_server_record_single_host_row"), "host <> '' OR id = 1")
        batch.create_unique_constraint(op.f("uq_control_server_record_host"), ["host"])


def downgrade() -> None:
    op.execute("DELETE FROM control_server_record WHERE host <> ''")
    with op.batch_alter_table("control_server_record") as batch:
        batch.drop_constraint(op.f("uq_control_server_record_host"), type_="unique")
        batch.drop_constraint(op.f("ck_control_server_record_single_host_row"), type_="check")
        batch.create_check_constraint(op.f("ck_control_server_record_single_row"), "id = 1")
        batch.drop_column("host")
    op.drop_table("cluster_hosts")
    for table in ("task_sessions", "runtime_update_jobs"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("host")
