"""The lean transcript (Issue 24 item 1): ``messages`` becomes ``transcript_entries``.

Every message row becomes a chunk whose cursor is its old row id (so a cursor a client holds
still means the same chunk); runs of text chunks that the new writer would have coalesced
(same session, kind, role, turn and instance, consecutive event seqs and consecutive ids) are
coalesced here too. Session, instance and turn ids become compact integers. Self-contained: it
uses none of the application's code, which may change after it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CHUNK_KINDS = ("agent_message_chunk", "agent_thought_chunk", "user_message_chunk")
ENTRY_TEXT_LIMIT = 2000
BATCH = 5000


def _varints(lengths: list[int]) -> bytes:
    out = bytearray()
    for n in lengths:
        while True:
            low = n & 0x7F
            n >>= 7
            if n:
                out.append(low | 0x80)
            else:
                out.append(low)
                break
    return bytes(out)


def _unvarints(data: bytes) -> list[int]:
    lengths: list[int] = []
    n = shift = 0
    for byte in data:
        n |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
        else:
            lengths.append(n)
            n = shift = 0
    return lengths


def _create_tables() -> None:
    op.create_table(
        "transcript_sessions",
        sa.Column("key", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("last_cursor", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_transcript_sessions")),
        sa.ForeignKeyConstraint(["session_id"], ["task_sessions.id"],
                                name=op.f("fk_transcript_sessions_session_id_task_sessions"), ondelete="CASCADE"),
        sa.UniqueConstraint("session_id", name=op.f("uq_transcript_sessions_session_id")),
    )
    op.create_table(
        "transcript_instances",
        sa.Column("key", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("instance_id", sa.String(128), nullable=False),
        sa.Column("session_key", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_transcript_instances")),
        sa.ForeignKeyConstraint(["session_key"], ["transcript_sessions.key"],
                                name=op.f("fk_transcript_instances_session_key_transcript_sessions"),
                                ondelete="CASCADE"),
        sa.UniqueConstraint("instance_id", name=op.f("uq_transcript_instances_instance_id")),
    )
    op.create_table(
        "transcript_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_key", sa.Integer(), nullable=False),
        sa.Column("cursor", sa.Integer(), nullable=False),
        sa.Column("last_cursor", sa.Integer(), nullable=False),
        sa.Column("turn", sa.Integer(), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("lengths", sa.LargeBinary(), nullable=True),
        sa.Column("instance_key", sa.Integer(), nullable=True),
        sa.Column("first_seq", sa.Integer(), nullable=True),
        sa.Column("last_seq", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transcript_entries")),
        sa.ForeignKeyConstraint(["session_key"], ["transcript_sessions.key"],
                                name=op.f("fk_transcript_entries_session_key_transcript_sessions"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["instance_key"], ["transcript_instances.key"],
                                name=op.f("fk_transcript_entries_instance_key_transcript_instances"),
                                ondelete="CASCADE"),
        sa.UniqueConstraint("session_key", "cursor", name=op.f("uq_transcript_entries_session_key_cursor")),
        sa.CheckConstraint("role IN ('user', 'agent', 'system')", name=op.f("ck_transcript_entries_role")),
    )
    op.create_index(op.f("ix_transcript_entries_instance_key_last_seq"), "transcript_entries",
                    ["instance_key", "last_seq"])


def upgrade() -> None:
    _create_tables()
    conn = op.get_bind()
    meta = sa.MetaData()
    messages = sa.Table("messages", meta, autoload_with=conn)
    turns = sa.Table("turns", meta, autoload_with=conn)
    sessions = sa.Table("transcript_sessions", meta, autoload_with=conn)
    instances = sa.Table("transcript_instances", meta, autoload_with=conn)
    entries = sa.Table("transcript_entries", meta, autoload_with=conn)

    # compact session keys, with the last cursor each session handed out (its largest old id)
    for sid, last in conn.execute(sa.select(messages.c.session_id, sa.func.max(messages.c.id))
                                  .group_by(messages.c.session_id).order_by(sa.func.min(messages.c.id))).all():
        conn.execute(sessions.insert().values(session_id=sid, last_cursor=last))
    session_keys = dict(conn.execute(sa.select(sessions.c.session_id, sessions.c.key)).all())
    # compact instance keys
    for iid, sid in conn.execute(sa.select(messages.c.instance_id, sa.func.min(messages.c.session_id))
                                 .where(messages.c.instance_id.is_not(None))
                                 .group_by(messages.c.instance_id)).all():
        conn.execute(instances.insert().values(instance_id=iid, session_key=session_keys[sid]))
    instance_keys = dict(conn.execute(sa.select(instances.c.instance_id, instances.c.key)).all())
    # turns by ordinal; a message naming a turn the store never recorded gets one (abandoned)
    orphans = conn.execute(sa.select(messages.c.session_id, messages.c.turn_id, sa.func.min(messages.c.created_at))
                           .where(messages.c.turn_id.is_not(None),
                                  messages.c.turn_id.not_in(sa.select(turns.c.id)))
                           .group_by(messages.c.session_id, messages.c.turn_id)
                           .order_by(sa.func.min(messages.c.id))).all()
    for sid, tid, started in orphans:
        ordinal = conn.execute(sa.select(sa.func.max(turns.c.ordinal)).where(turns.c.session_id == sid)).scalar()
        conn.execute(turns.insert().values(id=tid, session_id=sid, ordinal=(ordinal or 0) + 1, prompt="",
                                           state="abandoned", started_at=started, ended_at=started))
    ordinals = {tid: n for tid, n in conn.execute(sa.select(turns.c.id, turns.c.ordinal)).all()}

    pending: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    lengths: list[int] = []

    def close() -> None:
        if current is not None:
            current["lengths"] = _varints(lengths) if len(lengths) > 1 else None
            pending.append(current)
        if len(pending) >= BATCH:
            flush()

    def flush() -> None:
        if pending:
            conn.execute(entries.insert(), pending)
            pending.clear()

    result = conn.execute(sa.select(messages).order_by(messages.c.session_id, messages.c.id)
                          .execution_options(stream_results=True, yield_per=BATCH))
    for m in result:
        key = session_keys[m.session_id]
        turn = ordinals.get(m.turn_id) if m.turn_id is not None else None
        ikey = instance_keys.get(m.instance_id) if m.instance_id is not None else None
        if (current is not None and m.kind in CHUNK_KINDS and current["kind"] == m.kind
                and current["role"] == m.role and current["session_key"] == key and current["turn"] == turn
                and ikey is not None and current["instance_key"] == ikey and m.event_seq is not None
                and current["last_seq"] is not None and m.event_seq == current["last_seq"] + 1
                and m.id == current["last_cursor"] + 1
                and len(current["text"]) + len(m.text) <= ENTRY_TEXT_LIMIT):
            current["text"] += m.text
            current["last_cursor"] = m.id
            current["last_seq"] = m.event_seq
            lengths.append(len(m.text))
            continue
        close()
        created: datetime = m.created_at
        current = {"session_key": key, "cursor": m.id, "last_cursor": m.id, "turn": turn, "role": m.role,
                   "kind": m.kind, "text": m.text, "lengths": None, "instance_key": ikey,
                   "first_seq": m.event_seq, "last_seq": m.event_seq, "created_at": created}
        lengths = [len(m.text)]
    close()
    flush()
    op.drop_index(op.f("ix_messages_session_id"), table_name="messages")
    op.drop_table("messages")


def downgrade() -> None:
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
    conn = op.get_bind()
    meta = sa.MetaData()
    messages = sa.Table("messages", meta, autoload_with=conn)
    turns = sa.Table("turns", meta, autoload_with=conn)
    sessions = sa.Table("transcript_sessions", meta, autoload_with=conn)
    instances = sa.Table("transcript_instances", meta, autoload_with=conn)
    entries = sa.Table("transcript_entries", meta, autoload_with=conn)
    query = (sa.select(entries, sessions.c.session_id, instances.c.instance_id, turns.c.id.label("turn_id"))
             .join(sessions, sessions.c.key == entries.c.session_key)
             .outerjoin(instances, instances.c.key == entries.c.instance_key)
             .outerjoin(turns, sa.and_(turns.c.session_id == sessions.c.session_id, turns.c.ordinal == entries.c.turn))
             .order_by(entries.c.session_key, entries.c.cursor))
    # Cursors are per session now; old ids were global, so the rows are renumbered in order.
    rows: list[dict[str, Any]] = []
    for e in conn.execute(query):
        parts = _unvarints(e.lengths) if e.lengths is not None else [len(e.text)]
        offset = 0
        for i, n in enumerate(parts):
            rows.append({"session_id": e.session_id, "turn_id": e.turn_id, "role": e.role, "kind": e.kind,
                         "text": e.text[offset:offset + n], "instance_id": e.instance_id,
                         "event_seq": e.first_seq + i if e.first_seq is not None else None,
                         "created_at": e.created_at})
            offset += n
        if len(rows) >= BATCH:
            conn.execute(messages.insert(), rows)
            rows = []
    if rows:
        conn.execute(messages.insert(), rows)
    op.drop_index(op.f("ix_transcript_entries_instance_key_last_seq"), table_name="transcript_entries")
    op.drop_table("transcript_entries")
    op.drop_table("transcript_instances")
    op.drop_table("transcript_sessions")
