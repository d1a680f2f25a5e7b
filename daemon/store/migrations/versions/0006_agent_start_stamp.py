"""An agent's start as the kernel's boot id and its start in clock ticks since boot
(``daemon.host.process_start.stamp``), which no step of the wall clock moves: the recovery inventory
compared a recorded pid's wall-clock start time, which a clock step (NTP, a virtual machine
resumed) changes for a process that never stopped. Rows written before have none and keep the
wall-clock comparison.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("executors_running") as batch:
        batch.add_column(sa.Column("agent_pid_start_stamp", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("executors_running") as batch:
        batch.drop_column("agent_pid_start_stamp")
