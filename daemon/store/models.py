"""The backend's tables (docs/architecture.md#the-store), as SQLAlchemy 2 ORM classes.

The alembic migrations in ``migrations/versions`` are written by hand to match
these classes; a unit test compares the migrated schema with this metadata.
Change both together.

Timestamps are timezone-aware UTC in Python and stored as naive UTC. JSON
columns are not mutation-tracked: assign a new dict/list to change one.
State strings are the constants below, enforced by CHECK constraints.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from daemon.store.states import InventoryStatus, LaunchMode, SessionState, TaskState, TurnState

TASK_STATES = tuple(s.value for s in TaskState)
EXECUTORS = ("local", "worktree")
SESSION_STATES = tuple(s.value for s in SessionState)
TURN_STATES = tuple(s.value for s in TurnState)
MESSAGE_ROLES = ("user", "agent", "system")
INVENTORY_STATUSES = tuple(s.value for s in InventoryStatus)
LAUNCH_MODES = tuple(s.value for s in LaunchMode)
WORKFLOW_STEP_STATUSES = ("pending", "active", "blocked", "done")
CLUSTER_REQUEST_STATES = ("pending", "running", "done")
SINGLE_HOST = ""  # the control-server record's key on a single-host store

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in Python, naive UTC in the database."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware UTC datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[str]: JSON()}


class Installation(Base):
    """Spare key/value pairs about this installation."""

    __tablename__ = "installation"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Task(Base):
    __tablename__ = "tasks"
    __table_args__ = (
        CheckConstraint(_one_of("executor", EXECUTORS), name="executor"),
        CheckConstraint(_one_of("state", TASK_STATES), name="state"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    title: Mapped[str] = mapped_column(Text)
    workspace: Mapped[str | None] = mapped_column(Text)
    # origin's URL when the task was created (Issue 20): what its sessions' git endpoint may reach
    git_remote: Mapped[str | None] = mapped_column(Text)
    executor: Mapped[str] = mapped_column(String(16), default="local")
    state: Mapped[str] = mapped_column(String(16), default="backlog")
    interrupted: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class TaskSession(Base):
    __tablename__ = "task_sessions"
    __table_args__ = (
        CheckConstraint(_one_of("state", SESSION_STATES), name="state"),
        Index(None, "task_id", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    agent: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(32), default="CREATED")
    # acp.session_id, git_credential_snapshot, ...
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    passthrough: Mapped[bool] = mapped_column(Boolean, default=False)
    last_error: Mapped[str | None] = mapped_column(Text)
    # the cluster host whose backend drives it (Issue 47); None: a single-host store
    host: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Turn(Base):
    """A prompt turn; ``id`` is the control server's turn id."""

    __tablename__ = "turns"
    __table_args__ = (
        CheckConstraint(_one_of("state", TURN_STATES), name="state"),
        UniqueConstraint("session_id", "ordinal"),
    )
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("task_sessions.id", ondelete="CASCADE"))
    ordinal: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="open")
    stop_reason: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column()
    # True while its outcome is stored (startup recovery applied it) and its last events are still
    # being replayed: a follower on another host waits for them (Issue 47 item 3); None otherwise
    replaying: Mapped[bool | None] = mapped_column(Boolean)


class TranscriptSession(Base):
    """A session's compact key in the transcript, and the last cursor handed out in it.

    Cursors are per session and only grow (``daemon.store.transcript``); ``last_cursor`` is kept
    here so a cursor is never handed out twice, even after retention removed the entries.
    """

    __tablename__ = "transcript_sessions"
    key: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        ForeignKey("task_sessions.id", ondelete="CASCADE"), unique=True
    )
    last_cursor: Mapped[int] = mapped_column(Integer, default=0)


class TranscriptInstance(Base):
    """An agent instance's compact key in the transcript."""

    __tablename__ = "transcript_instances"
    key: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(128), unique=True)
    session_key: Mapped[int] = mapped_column(ForeignKey("transcript_sessions.key", ondelete="CASCADE"))


class TranscriptEntry(Base):
    """The transcript: one row per entry; consecutive chunks of one turn from one agent share one.

    An entry covers the chunks with cursors ``cursor``..``last_cursor`` of its session and the
    events ``first_seq``..``last_seq`` of its instance (consecutive, one chunk per event);
    ``lengths`` cuts ``text`` back into its chunks (``daemon.store.transcript``). ``turn`` is the
    turn's ordinal in its session.
    """

    __tablename__ = "transcript_entries"
    __table_args__ = (
        CheckConstraint(_one_of("role", MESSAGE_ROLES), name="role"),
        UniqueConstraint("session_key", "cursor"),
        Index(None, "instance_key", "last_seq"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_key: Mapped[int] = mapped_column(ForeignKey("transcript_sessions.key", ondelete="CASCADE"))
    cursor: Mapped[int] = mapped_column(Integer)
    last_cursor: Mapped[int] = mapped_column(Integer)
    turn: Mapped[int | None] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(64))
    text: Mapped[str] = mapped_column(Text)
    lengths: Mapped[bytes | None] = mapped_column(LargeBinary)
    instance_key: Mapped[int | None] = mapped_column(
        ForeignKey("transcript_instances.key", ondelete="CASCADE")
    )
    first_seq: Mapped[int | None] = mapped_column(Integer)
    last_seq: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ExecutorRunning(Base):
    """The recovery inventory: one row per session with a (possibly) running agent."""

    __tablename__ = "executors_running"
    __table_args__ = (CheckConstraint(_one_of("status", INVENTORY_STATUSES), name="status"),)
    session_id: Mapped[str] = mapped_column(
        ForeignKey("task_sessions.id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    instance_id: Mapped[str] = mapped_column(String(128))  # the agent execution id
    endpoint: Mapped[str] = mapped_column(Text)  # control-server socket at creation
    agent_pid: Mapped[int | None] = mapped_column(Integer)
    agent_pid_start_time: Mapped[float | None] = mapped_column(Float)  # wall clock, for people
    agent_pid_start_stamp: Mapped[str | None] = mapped_column(String(64))  # daemon.host.process_start.stamp
    resume_token: Mapped[str | None] = mapped_column(Text)
    worktree_path: Mapped[str | None] = mapped_column(Text)
    workspace_path: Mapped[str] = mapped_column(Text)
    runtime: Mapped[str] = mapped_column(String(32), default="standalone")
    agent_profile: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="live")
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0)  # highest seq durably applied
    created_by_boot: Mapped[str] = mapped_column(String(64))
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ControlServerRecord(Base):
    """A host's control-server record, one per ``host`` (Issue 47): ``SINGLE_HOST`` (``""``) on a
    single-host store, whose record is always ``id = 1``; a cluster host's name otherwise
    (``daemon.backend.cluster.identity``). ``credential_ref`` names a secret file."""

    __tablename__ = "control_server_record"
    __table_args__ = (
        CheckConstraint("host <> '' OR id = 1", name="single_host_row"),
        CheckConstraint(_one_of("launch_mode", LAUNCH_MODES), name="launch_mode"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False, default=1)
    host: Mapped[str] = mapped_column(String(64), unique=True, default=SINGLE_HOST, server_default=SINGLE_HOST)
    endpoint: Mapped[str] = mapped_column(Text)
    server_identity: Mapped[str] = mapped_column(String(128))
    credential_ref: Mapped[str] = mapped_column(String(128))
    capabilities: Mapped[list[str]] = mapped_column(default=list)
    log_path: Mapped[str | None] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    pid_start_time: Mapped[float | None] = mapped_column(Float)
    launch_mode: Mapped[str] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ClusterHost(Base):
    """One host of a cluster (Issue 47, docs/cluster.md): the backend that claimed the name (its
    installation, pid, machine, version), when it started, its last heartbeat, and when it stopped
    cleanly (None while it runs, or after it died without stopping)."""

    __tablename__ = "cluster_hosts"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    installation_id: Mapped[str] = mapped_column(String(64))
    pid: Mapped[int] = mapped_column(Integer)
    machine: Mapped[str] = mapped_column(Text)
    version: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column()


class CredentialLease(Base):
    """A git credential lease; only the token's hash is stored."""

    __tablename__ = "credential_leases"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    session_id: Mapped[str] = mapped_column(ForeignKey("task_sessions.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    expires_at: Mapped[datetime] = mapped_column()
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class RuntimeUpdateJob(Base):
    """A runtime update job of one host (``host``: its cluster host, None on a single host)."""

    __tablename__ = "runtime_update_jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    agent: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(32))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class WorkflowStep(Base):
    """One named step of a task's workflow (docs/requirements.md#runtime-configuration-across-a-context-reset), in ``position`` order.

    At most one step of a task is ``active`` or ``blocked`` (the current one: blocked when its
    entry actions failed, e.g. a context reset whose restore was rejected, so its automatic
    prompt was not sent); steps before it are ``done``, after it ``pending``.
    """

    __tablename__ = "workflow_steps"
    __table_args__ = (CheckConstraint(_one_of("status", WORKFLOW_STEP_STATUSES), name="status"),)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(64))
    reset_context: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    detail: Mapped[str | None] = mapped_column(Text)
    entered_at: Mapped[datetime | None] = mapped_column()


class TaskWorkspace(Base):
    """The host paths kandev acts on for a task, recorded when kandev creates or accepts them
    (``daemon.backend.git.workspace_record``): before any removal, bind or git on the host, the path on
    disk is checked against this row (resolved path, no symlink, owner). Nothing an agent can write
    (a ``.git`` file, ``commondir``, ``gitdir``, a symlink) ever replaces it.

    ``path``: the workspace, resolved; ``owner_uid``: the owner of its top directory; ``created``:
    kandev made it (under ``<home>/worktrees``) and removes it with the task. A git worktree also
    records its ``repository`` (the directory the user named), the repository's git directory
    (``git_common_dir``, owned by ``git_owner_uid``) and the worktree's administrative directory
    (``git_admin_dir``: ``<git_common_dir>/worktrees/<name>``)."""

    __tablename__ = "task_workspaces"
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    owner_uid: Mapped[int] = mapped_column(Integer)
    created: Mapped[bool] = mapped_column(Boolean, default=False)
    repository: Mapped[str | None] = mapped_column(Text)
    git_common_dir: Mapped[str | None] = mapped_column(Text)
    git_admin_dir: Mapped[str | None] = mapped_column(Text)
    git_owner_uid: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ClusterRequest(Base):
    """An op on a session another host owns (Issue 47; ``daemon.backend.cluster.requests``): written
    by the requesting backend (``origin_host``), claimed and carried out by the backend of ``host``
    with the handler a local CLI call uses, its ``result`` or typed ``error`` ({code, message,
    retryable, details}) written back. ``state``: ``pending`` (written), ``running`` (claimed: it
    is never run a second time), ``done`` (answered, or given up before anyone claimed it)."""

    __tablename__ = "cluster_requests"
    __table_args__ = (
        CheckConstraint(_one_of("state", CLUSTER_REQUEST_STATES), name="state"),
        Index("ix_cluster_requests_host_state", "host", "state"),
    )
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    host: Mapped[str] = mapped_column(String(64))
    origin_host: Mapped[str] = mapped_column(String(64))
    op: Mapped[str] = mapped_column(String(64))
    args: Mapped[dict[str, Any]] = mapped_column()
    state: Mapped[str] = mapped_column(String(16), default="pending")
    result: Mapped[dict[str, Any] | None] = mapped_column()
    error: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    claimed_at: Mapped[datetime | None] = mapped_column()
    done_at: Mapped[datetime | None] = mapped_column()
