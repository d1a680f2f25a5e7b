"""Requests between the hosts of a cluster (Issue 47 item 2): an op on a session another host owns is
a row here, claimed and carried out by the owning host's backend, its result written back
(``daemon.backend.cluster.requests``). A single-host store has the table too, always empty.

``turns.replaying``: a turn whose outcome startup recovery stored before the replay of its last
events (until its ``turn_ended`` event is applied), so that a ``follow`` on another host, which
cannot see the owner's memory, waits for those events too.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cluster_requests",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("host", sa.String(64), nullable=False),
        sa.Column("origin_host", sa.String(64), nullable=False),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("claimed_at", sa.DateTime(), nullable=True),
        sa.Column("done_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cluster_requests")),
        sa.CheckConstraint("state IN ('pending', 'running', 'done')", name=op.f("ck_cluster_requests_state")),
    )
    op.create_index("ix_cluster_requests_host_state", "cluster_requests", ["host", "state"])
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("replaying", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("replaying")
    op.drop_index("ix_cluster_requests_host_state", table_name="cluster_requests")
    op.drop_table("cluster_requests")
