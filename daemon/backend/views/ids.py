"""Short ids: a unique prefix of a task, session or permission-request id stands for the whole id.

Task and session ids are 32 lowercase hex characters, which nobody types. Every backend op that
takes a ``task_id`` or ``session_id`` (and ``permission_respond``'s ``request_id``, among the
requests of its session) accepts a prefix of at least ``MIN_PREFIX`` hex characters instead,
as ``docker`` and ``git`` do:

- exactly one match: the op runs with the full id, as if it had been given;
- several: refused with the typed error ``ambiguous_id``, whose message lists the candidates
  (``details.candidates`` holds them for programs) and nothing changes;
- none: the id is passed on unchanged, so the op answers ``not_found`` naming what was given.

A full id, or anything that is not 4..31 hex characters, is passed on untouched without reading
the store, so full ids behave exactly as before. The resolution lives here, in one wrapper around
the handler table (``resolving``), so every op and every client (``--json`` scripts too) gets it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.backend.views.session_view import permissions
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession
from ipc.errors import ErrorCode, IpcError
from ipc.schema import OpTable
from ipc.server import ConnectionContext

MIN_PREFIX = 4
"""The fewest characters of an id accepted as a prefix."""
CANDIDATES_SHOWN = 10
"""Candidates an ``ambiguous_id`` error lists at most (it also says how many there are)."""
_PREFIX = re.compile(rf"[0-9a-fA-F]{{{MIN_PREFIX},31}}")

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]


class IdKind(Enum):
    """What an id names, with the argument that carries it."""

    TASK = "task_id"
    SESSION = "session_id"
    PERMISSION_REQUEST = "request_id"

    @property
    def noun(self) -> str:
        return {"task_id": "task", "session_id": "session", "request_id": "permission request"}[self.value]


def is_prefix(text: str) -> bool:
    """Whether ``text`` is looked up as a prefix (4..31 hex characters), not as a whole id."""
    return _PREFIX.fullmatch(text) is not None


def _ambiguous(kind: IdKind, given: str, candidates: list[str], total: int) -> IpcError:
    shown = ", ".join(candidates)
    more = f" and {total - len(candidates)} more" if total > len(candidates) else ""
    return IpcError(
        ErrorCode.AMBIGUOUS_ID,
        f"{kind.noun} id {given!r} is ambiguous: it is the start of {total} {kind.noun}s: {shown}{more}"
        " (give more characters)",
        False,
        {"kind": kind.noun, "given": given, "candidates": candidates, "total": total},
    )


def _pick(kind: IdKind, given: str, candidates: list[str], total: int) -> str:
    if total == 1:
        return candidates[0]
    if total == 0:
        return given  # the op answers not_found, naming what was given
    raise _ambiguous(kind, given, candidates, total)


def resolve(db: Session, kind: IdKind, given: str) -> str:
    """The full task or session id ``given`` stands for (see the module doc)."""
    if not is_prefix(given):
        return given
    prefix = given.lower()
    column = Task.id if kind is IdKind.TASK else TaskSession.id
    match = column.startswith(prefix, autoescape=True)
    candidates = list(db.scalars(select(column).where(match).order_by(column).limit(CANDIDATES_SHOWN)))
    total = len(candidates)
    if total == CANDIDATES_SHOWN:
        total = int(db.scalar(select(func.count()).select_from(column.table).where(match)) or 0)
    return _pick(kind, given, candidates, total)


def resolve_request(db: Session, session_id: str, given: str) -> str:
    """The full id of one of the session's permission requests that ``given`` starts."""
    if not is_prefix(given):
        return given
    prefix = given.lower()
    matches = sorted({p["request_id"] for p in permissions(db, session_id) if p["request_id"].startswith(prefix)})
    return _pick(IdKind.PERMISSION_REQUEST, given, matches[:CANDIDATES_SHOWN], len(matches))


@dataclass(frozen=True)
class IdResolver:
    """Resolves the id arguments of a request against one store (in a worker thread)."""

    store: Store

    def resolve_args(self, kinds: tuple[IdKind, ...], args: dict[str, Any]) -> dict[str, Any]:
        out = dict(args)
        with self.store.session() as db:
            for kind in kinds:
                value = out.get(kind.value)
                if not isinstance(value, str):
                    continue
                if kind is IdKind.PERMISSION_REQUEST:
                    session_id = out.get(IdKind.SESSION.value)
                    if isinstance(session_id, str):
                        out[kind.value] = resolve_request(db, session_id, value)
                else:
                    out[kind.value] = resolve(db, kind, value)
        return out

    def wrap(self, kinds: tuple[IdKind, ...], handler: Handler) -> Handler:
        async def resolving_handler(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            if any(isinstance(v := args.get(k.value), str) and is_prefix(v) for k in kinds):
                # A prefix reads the store: off the event loop (full ids never get here).
                args = await asyncio.to_thread(self.resolve_args, kinds, args)
            return await handler(ctx, args)

        resolving_handler.__name__ = getattr(handler, "__name__", "handler")
        return resolving_handler


def _kinds(table: OpTable, name: str) -> tuple[IdKind, ...]:
    if name not in table:
        return ()
    op = table.get(name)
    declared = set(op.required) | set(op.optional)
    kinds = [k for k in (IdKind.TASK, IdKind.SESSION) if k.value in declared]
    if IdKind.SESSION in kinds and IdKind.PERMISSION_REQUEST.value in declared:
        kinds.append(IdKind.PERMISSION_REQUEST)  # after the session: requests are looked up in it
    return tuple(kinds)


def resolving(table: OpTable, store: Store, handlers: Mapping[str, Handler]) -> dict[str, Handler]:
    """``handlers`` with every op that takes a task, session or request id accepting a prefix."""
    resolver = IdResolver(store)
    out: dict[str, Handler] = {}
    for name, handler in handlers.items():
        kinds = _kinds(table, name)
        out[name] = resolver.wrap(kinds, handler) if kinds else handler
    return out
