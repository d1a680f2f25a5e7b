"""``kandev follow SESSION`` and ``kandev prompt SESSION TEXT --follow``: the agent's output, live.

The client of the backend's ``follow`` stream op (``daemon.backend.views.follow``), on a connection of
its own. It prints each transcript entry as it arrives (``ConversationWriter``: text chunks
joined, tool calls and permission requests on lines of their own) and a line when the turn ends.
While the turn's agent says nothing for ``agents.quiet_warning_s`` (and again at each multiple) it
says so on stderr, with a hint: ``waiting for the agent: no output for 30 s``.

If the connection to the backend is lost (the backend was SIGKILLed, ``kandev down``/``up``,
``systemctl restart``) it says so on stderr, reconnects, and asks for what comes after the last
entry it printed (``after_seq``) of the same turn: nothing is printed twice or skipped. It gives
up after ``reconnect_timeout`` seconds without a backend.

Exit status: 0 the turn ended with ``end_turn``; 1 it ended otherwise (refused, cancelled,
failed, the agent died) or there was nothing to follow; 3 the backend stayed unreachable.
With ``--all`` it follows every turn until interrupted (Ctrl-C: status 0).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import IO, Any

from daemon.api.ops import FollowEnd, FollowEvent
from daemon.cli.human import RECONNECT_TIMEOUT_S
from daemon.cli.human.fmt import quiet_hint, quiet_text, short, stop_reason_ok
from daemon.cli.human.term import Term
from daemon.cli.human.transcript import ConversationWriter
from ipc.client import AsyncClient
from ipc.errors import ErrorCode, IpcError

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 3
RETRY_MIN_S, RETRY_MAX_S = 0.1, 1.0
_RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN, ErrorCode.TIMEOUT,
                        ErrorCode.IDLE_TIMEOUT, ErrorCode.BUFFERS_FULL})


class BackendGone(Exception):
    """The backend did not come back within the reconnect timeout."""


@dataclass
class FollowResult:
    status: int
    reason: str  # turn_ended | no_agent | interrupted


class Follower:
    """Follows one session through reconnections; ``run()`` returns the exit status."""

    def __init__(self, socket: str, session: str, *, out: IO[str], err: IO[str], term: Term,
                 turn_id: str | None = None, follow_all: bool = False,
                 reconnect_timeout: float = RECONNECT_TIMEOUT_S, protocol_major: int = 1,
                 json_lines: bool = False) -> None:
        self.socket = socket
        self.json_lines = json_lines  # --json: each event as one JSON object per line
        self.session = session
        self.turn_id = turn_id
        self.follow_all = follow_all
        self.reconnect_timeout = reconnect_timeout
        self.protocol_major = protocol_major
        self.out, self.err, self.term = out, err, term
        self.cursor: int | None = None  # the last entry printed (or where the stream started)
        self.outcome: dict[str, Any] | None = None  # the followed turn's end, once seen
        self.ended_turns: set[str] = set()
        self.hinted_turns: set[Any] = set()  # turns whose silence was explained with a hint
        self.writer: ConversationWriter | None = None

    def _say(self, text: str) -> None:
        if self.writer is not None:
            self.writer.end_run()
        self.err.write(f"kandev: {text}\n")
        self.err.flush()

    def _args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"session_id": self.session, "all": self.follow_all}
        if self.cursor is not None:
            args["after_seq"] = self.cursor
        if self.turn_id is not None:
            args["turn_id"] = self.turn_id
        return args

    async def _open(self) -> Any:
        client = await AsyncClient.connect(self.socket, protocol_major=self.protocol_major, timeout=5.0)
        return await client.stream("follow", self._args(), timeout=30.0)

    async def _reopen(self, lost: IpcError | None) -> Any:
        """Connect again until the backend answers or the reconnect timeout passes."""
        why = f" ({lost.message})" if lost is not None and lost.message else ""
        self._say(f"lost the connection to the backend{why}; reconnecting"
                  f" (for up to {self.reconnect_timeout:g} s)")
        deadline = time.monotonic() + self.reconnect_timeout
        delay = RETRY_MIN_S
        while True:
            try:
                stream = await self._open()
            except IpcError as exc:
                if exc.code not in _RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise BackendGone(f"the backend did not come back within {self.reconnect_timeout:g} s"
                                      f" ({exc.message})") from None
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            where = f"after entry {self.cursor}" if self.cursor is not None else "from the start"
            self._say(f"reconnected to the backend (pid {await self._backend_pid()}); resuming {where}")
            return stream

    async def _backend_pid(self) -> str:
        try:
            async with await AsyncClient.connect(self.socket, protocol_major=self.protocol_major) as client:
                status = await client.call("status", timeout=5.0)
                return str(status["backend"]["pid"])
        except (IpcError, KeyError, TypeError):
            return "?"

    def _started(self, result: dict[str, Any]) -> None:
        self.session = str(result.get("session_id") or self.session)
        if self.turn_id is None and result.get("turn_id"):
            self.turn_id = str(result["turn_id"])
        if self.cursor is None:
            self.cursor = int(result.get("after_seq") or 0)
        if self.writer is None:
            self.writer = ConversationWriter(self.out, self.term, self.session, live=True)
            if result.get("turn_id") is None and not self.follow_all:
                self._say(f"session {short(self.session)} has no turn yet; waiting for the first one")

    def _event(self, kind: str, seq: int, data: dict[str, Any]) -> str | None:
        """Print one event; the end reason when the stream is over."""
        writer = self.writer
        assert writer is not None
        if kind == FollowEvent.ENTRY:
            if self.cursor is not None and seq <= self.cursor:
                return None  # already printed before a reconnection
            if self.follow_all and data.get("kind") == "prompt" and data.get("turn_id"):
                self.turn_id = str(data["turn_id"])
            if self.json_lines:
                self._json(seq, kind, data)
            else:
                writer.entry(data)
            self.cursor = seq
            return None
        if kind == FollowEvent.TURN_ENDED:
            turn = str(data.get("turn_id"))
            if turn not in self.ended_turns:
                self.ended_turns.add(turn)
                if self.json_lines:
                    self._json(seq, kind, data)
                else:
                    writer.turn_ended(data)
            if not self.follow_all:
                self.outcome = data
                return FollowEnd.TURN_ENDED.value
            return None
        if kind == FollowEvent.QUIET:  # the turn goes on; its agent has said nothing for a while
            if self.json_lines:
                self._json(seq, kind, data)
            else:
                self._say(quiet_text(data))
                if data.get("turn_id") not in self.hinted_turns:  # the hint once a turn, not at every step
                    self.hinted_turns.add(data.get("turn_id"))
                    self.err.write(f"hint: {quiet_hint(data)}\n")
                    self.err.flush()
            return None
        if kind == FollowEvent.END:
            return str(data.get("reason") or "end")
        return None

    def _json(self, seq: int, kind: str, data: dict[str, Any]) -> None:
        self.out.write(json.dumps({"seq": seq, "kind": kind, "data": data}, sort_keys=True) + "\n")
        self.out.flush()

    async def run(self) -> FollowResult:
        try:
            stream = await self._open()
        except IpcError:
            raise  # the first connection: refused or unreachable like any other command
        while True:
            self._started(stream.result or {})
            lost: IpcError | None = None
            reason: str | None = None
            try:
                async for ev in stream:
                    reason = self._event(ev.kind, ev.seq, ev.data if isinstance(ev.data, dict) else {})
                    if reason is not None:
                        break
            except IpcError as exc:
                if exc.code not in _RETRYABLE and exc.code != ErrorCode.INVALID_FRAME:
                    raise
                lost = exc
            finally:
                await stream.close()
            if self.writer is not None:
                self.writer.end_run()
                self.out.flush()
            if reason is not None:
                return self._finish(reason)
            if self.outcome is not None:
                return self._finish(FollowEnd.TURN_ENDED.value)
            stream = await self._reopen(lost)

    def _finish(self, reason: str) -> FollowResult:
        if reason == FollowEnd.TURN_ENDED and self.outcome is not None:
            o = self.outcome
            ok = stop_reason_ok(o.get("state"), o.get("stop_reason"), o.get("error"))
            return FollowResult(EXIT_OK if ok else EXIT_FAILED, reason)
        if reason == FollowEnd.NO_AGENT:
            self._say(f"session {short(self.session)} has no running agent and no turn to follow")
            self.err.write(f"hint: `kandev resume {short(self.session)}` gives it an agent again\n")
        return FollowResult(EXIT_FAILED, reason)


def follow(socket: str, session: str, *, out: IO[str], err: IO[str], term: Term, turn_id: str | None = None,
           follow_all: bool = False, reconnect_timeout: float = RECONNECT_TIMEOUT_S,
           protocol_major: int = 1, json_lines: bool = False) -> int:
    """Run a ``Follower`` to its end; the exit status (raises ``IpcError`` for the first refusal)."""
    follower = Follower(socket, session, out=out, err=err, term=term, turn_id=turn_id, follow_all=follow_all,
                        reconnect_timeout=reconnect_timeout, protocol_major=protocol_major,
                        json_lines=json_lines)
    try:
        return asyncio.run(follower.run()).status
    except KeyboardInterrupt:
        if follower.writer is not None:
            follower.writer.end_run()
        out.flush()
        return EXIT_OK if follow_all else 130
    except BackendGone as exc:
        if follower.writer is not None:
            follower.writer.end_run()
        err.write(f"kandev: {exc}\nhint: `kandev status` / `kandev up` (or `systemctl status kandev-backend`)\n")
        return EXIT_UNREACHABLE
