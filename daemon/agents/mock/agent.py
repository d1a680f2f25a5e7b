"""The built-in scriptable mock ACP agent.

Run as ``python -m daemon.agents.mock``: one ACP conversation over stdio
(JSON-RPC, newline-delimited, protocol version 1), spoken with
:mod:`daemon.agents.mock.acp_wire` rather than the ACP SDK, whose import would cost each start
~0.3 s of CPU more (the control server, the ACP client, still uses the SDK, and
tests/integration/test_mock_agent.py talks to it through the SDK's client side).
stdout is the protocol channel; one log line per request goes to stderr.

Sessions are persisted by :mod:`daemon.agents.mock.state` (an atomically replaced
state file plus an append-only history, one line per chunk), so ``session/load``
in a new process replays the history and restores mode and config options. The replay is
one notification per message (a run of one role's chunks, joined), as real agents replay a
conversation, not one per chunk streamed (``SessionRecord.messages``).

Prompt scripts (on the text of the prompt)::

    plain text   one chunk "echo: <text>", stop reason end_turn
    /slow N      chunk "i/N " for i = 1..N, one per second (N seconds)
    /flood N     chunk "i/N " for i = 1..N, as fast as the pipe takes them
    /permission  session/request_permission (allow | reject), then a chunk
                 "permission: <option id | cancelled>"
    /fail        the prompt is answered with a JSON-RPC error
    /exit C      chunk "exiting C", then the process exits with code C
    /git-credential
                 checks the session's git lease for the workspace's ``origin`` with the
                 session's credential endpoint, as kandev's git transport does before each
                 fetch or push (``daemon.git_credential_helper.valid_lease``, with the
                 agent's own environment); one chunk "git-credential: ok repository=H/O/N
                 lease-sha256=D" (first 12 hex of the lease token's SHA-256, never the
                 token) or "git-credential: failed: <reason>"
    /sh CMD      runs ``sh -c CMD`` as a child of the agent in the session's cwd, in a
                 process group of its own (the way an agent's terminal tool does); one chunk
                 "sh: exit=<code>" followed by a newline and the first 4 KiB of its combined
                 stdout and stderr; a cancel ends the command's whole process group
                 (SIGTERM, then SIGKILL), what it put in the background included
    /silent N    says nothing at all for N seconds (a provider that does not answer), then one
                 chunk "silent: N s"; a cancel ends it at once, with no chunk
    /hang N      says nothing for N seconds and ignores a cancel (a wedged agent), then one
                 chunk "hang: N s"
    /stderr N    writes N bytes (lines of "x") to the agent's own stderr, then one chunk
                 "stderr: wrote N" (a chatty or flooding agent)
    /alloc N     the agent itself allocates N MiB and writes every page of it (a 1 MiB block at a
                 time, kept until the process ends), then one chunk "alloc: N MiB"; an agent
                 over its memory bound (agents.max_memory) is killed on the way
    /other       treated as plain text (echo)

``session/cancel`` stops /slow and /flood between chunks, and /silent; the prompt then
ends with stop reason ``cancelled``. A chunk whose recording fails because
the state dir's filesystem is full is recorded again every
``ENOSPC_RETRY_S`` until it fits (the agent waits for space, it does not fail
its turn).

A ``session/new`` on a process that already has a session (a context reset)
sends ``current_mode_update`` and ``config_option_update`` with the new
session's defaults before it answers.

Failure switches, read from ``<workspace>/.kandev-mock.toml`` at each request
(workspace = the session's cwd; the process cwd for ``initialize``):
``fail_initialize = true`` (exit 3 before answering), ``fail_load = true``,
``exit_on_load = true`` (exit 4 before answering ``session/load``),
``replay_after_load = true`` (replay the history after answering ``session/load``, one update
every 50 ms, as Gemini CLI does),
``reject_mode = "plan"``, ``reject_option = "effort=high"``.

The legacy ``session/set_model`` is not offered (the SDK's agents answer it "Method not
found" too, as any method the agent does not implement); the model is the ``model`` config
option.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import signal
import sys
import uuid
from typing import Any

from daemon.agents.mock.acp_wire import (
    PROTOCOL_VERSION,
    AgentWire,
    NotificationHandler,
    Params,
    RequestHandler,
    RpcError,
    stdio_wire,
)
from daemon.agents.mock.state import (
    CONFIG_VALUES,
    MODES,
    SessionRecord,
    read_switches,
    state_dir,
)
from daemon.agents.registry import get_agent
from ipc.aio import within

log = logging.getLogger("kandev.mock")

SLOW_INTERVAL = 1.0
ENOSPC_RETRY_S = 0.2
"""Seconds between attempts to record a chunk while its state dir's filesystem is full."""
PERMISSION_OPTIONS = [
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
]
_CONFIG_LABELS = {"model": ("Model", "model"), "effort": ("Effort", "thought_level")}
StopReason = str


def _rejected(switch: Any, value: str) -> bool:
    """Whether a ``reject_*`` switch (a string or a list of strings) names ``value``."""
    return value == switch or (isinstance(switch, list) and value in switch)


def _int_arg(args: list[str]) -> int | None:
    if len(args) != 1:
        return None
    try:
        return int(args[0])
    except ValueError:
        return None


def _modes(rec: SessionRecord) -> dict[str, Any]:
    return {"currentModeId": rec.mode, "availableModes": [{"id": m, "name": m.capitalize()} for m in MODES]}


def _config_options(rec: SessionRecord) -> list[dict[str, Any]]:
    return [
        {
            "id": config_id,
            "name": _CONFIG_LABELS[config_id][0],
            "category": _CONFIG_LABELS[config_id][1],
            "type": "select",
            "currentValue": rec.config[config_id],
            "options": [{"value": v, "name": v} for v in values],
        }
        for config_id, values in CONFIG_VALUES.items()
    ]


def _text_update(kind: str, text: str) -> dict[str, Any]:
    """An ``agent_message_chunk`` or ``user_message_chunk`` update of one text block."""
    return {"sessionUpdate": kind, "content": {"type": "text", "text": text}}


def _str_param(params: Params, name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise RpcError.invalid_params({name: value, "details": f"{name} must be a string"})
    return value


class MockAgent:
    """The ACP agent methods the mock supports (``handlers``); any other is ``Method not found``."""

    def __init__(self) -> None:
        self._wire: AgentWire | None = None
        self._sessions: dict[str, SessionRecord] = {}
        self._turns: dict[str, asyncio.Event] = {}  # session id -> cancel flag of its running turn
        self._replay_task: asyncio.Task[None] | None = None  # a replay after the load's answer

    def handlers(self) -> tuple[dict[str, RequestHandler], dict[str, NotificationHandler]]:
        """The requests and the notifications the mock answers, by ACP method name."""
        requests: dict[str, RequestHandler] = {
            "initialize": self.initialize,
            "session/new": self.new_session,
            "session/load": self.load_session,
            "session/set_mode": self.set_session_mode,
            "session/set_config_option": self.set_config_option,
            "session/prompt": self.prompt,
        }
        return requests, {"session/cancel": self.cancel}

    def connect(self, wire: AgentWire) -> None:
        self._wire = wire

    @property
    def wire(self) -> AgentWire:
        assert self._wire is not None, "connect was not called"
        return self._wire

    def _session(self, session_id: str) -> SessionRecord:
        rec = self._sessions.get(session_id)
        if rec is None:
            raise RpcError.invalid_params({"sessionId": session_id, "details": "unknown session"})
        return rec

    async def _update(self, session_id: str, update: dict[str, Any]) -> None:
        await self.wire.notify("session/update", {"sessionId": session_id, "update": update})

    async def _say(self, rec: SessionRecord, text: str) -> None:
        """Send one agent message chunk, then record it (so a kill never records an unsent chunk)."""
        await self._update(rec.session_id, _text_update("agent_message_chunk", text))
        while True:
            try:
                rec.append("agent", text)
                return
            except OSError as exc:  # a full disk: wait for space like a careful agent (Issue 21 scenario E)
                if exc.errno != errno.ENOSPC:
                    raise
                await asyncio.sleep(ENOSPC_RETRY_S)

    # -- lifecycle -----------------------------------------------------------

    async def initialize(self, params: Params) -> dict[str, Any]:
        log.info("initialize protocol_version=%s", params.get("protocolVersion"))
        if read_switches(os.getcwd()).get("fail_initialize"):
            log.info("fail_initialize set: exiting 3")
            os._exit(3)
        agent = get_agent("mock")
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "agentCapabilities": {"loadSession": True},
            "agentInfo": {"name": "kandev-mock", "version": agent.version},
        }

    async def new_session(self, params: Params) -> dict[str, Any]:
        cwd = _str_param(params, "cwd")
        rec = SessionRecord(session_id=uuid.uuid4().hex, cwd=cwd)
        rec.save()
        reset = bool(self._sessions)
        self._sessions[rec.session_id] = rec
        log.info("session/new cwd=%s -> %s (state %s)", cwd, rec.session_id, rec.path)
        if reset:
            # A new session on a process that already has one is a context reset: like real
            # adapters, it announces its defaults before it answers (the race RESETCFG-1 and RESETCFG-5 guard against).
            await self._update(rec.session_id, {"sessionUpdate": "current_mode_update", "currentModeId": rec.mode})
            await self._update(rec.session_id,
                               {"sessionUpdate": "config_option_update", "configOptions": _config_options(rec)})
        return {"sessionId": rec.session_id, "modes": _modes(rec), "configOptions": _config_options(rec)}

    async def load_session(self, params: Params) -> dict[str, Any]:
        cwd, session_id = _str_param(params, "cwd"), _str_param(params, "sessionId")
        log.info("session/load cwd=%s session=%s", cwd, session_id)
        switches = read_switches(cwd)
        if switches.get("exit_on_load"):  # the transport drops before session/load completes
            log.info("exit_on_load set: exiting 4")
            os._exit(4)
        if switches.get("fail_load"):
            raise RpcError.internal_error({"details": "fail_load is set in .kandev-mock.toml"})
        rec = SessionRecord.load(session_id, cwd)
        if rec is None:
            raise RpcError.invalid_params({"sessionId": session_id, "details": f"no such session in {state_dir(cwd)}"})
        if switches.get("replay_after_load"):
            self._replay_task = asyncio.create_task(self._replay(session_id, rec, pace=0.05))
        else:
            await self._replay(session_id, rec)
        self._sessions[session_id] = rec
        return {"modes": _modes(rec), "configOptions": _config_options(rec)}

    async def _replay(self, session_id: str, rec: SessionRecord, pace: float = 0.0) -> None:
        for entry in rec.messages():
            if pace:
                await asyncio.sleep(pace)
            kind = "user_message_chunk" if entry.role == "user" else "agent_message_chunk"
            await self._update(session_id, _text_update(kind, entry.text))

    # -- runtime configuration -----------------------------------------------

    async def set_session_mode(self, params: Params) -> dict[str, Any]:
        session_id, mode_id = _str_param(params, "sessionId"), _str_param(params, "modeId")
        log.info("session/set_mode session=%s mode=%s", session_id, mode_id)
        rec = self._session(session_id)
        if mode_id not in MODES:
            raise RpcError.invalid_params({"modeId": mode_id, "details": f"modes are {list(MODES)}"})
        if _rejected(read_switches(rec.cwd).get("reject_mode"), mode_id):
            raise RpcError.internal_error({"details": f"mode {mode_id!r} rejected by .kandev-mock.toml"})
        if rec.mode != mode_id:
            rec.mode = mode_id
            rec.save()
            await self._update(session_id, {"sessionUpdate": "current_mode_update", "currentModeId": mode_id})
        return {}

    async def set_config_option(self, params: Params) -> dict[str, Any]:
        session_id, config_id, value = _str_param(params, "sessionId"), _str_param(params, "configId"), params.get("value")
        log.info("session/set_config_option session=%s %s=%s", session_id, config_id, value)
        rec = self._session(session_id)
        allowed = CONFIG_VALUES.get(config_id)
        if allowed is None or not isinstance(value, str) or value not in allowed:
            raise RpcError.invalid_params({"configId": config_id, "value": value, "details": f"options are {CONFIG_VALUES}"})
        if _rejected(read_switches(rec.cwd).get("reject_option"), f"{config_id}={value}"):
            raise RpcError.internal_error({"details": f"option {config_id}={value} rejected by .kandev-mock.toml"})
        if rec.config[config_id] != value:
            rec.config[config_id] = value
            rec.save()
            await self._update(session_id, {"sessionUpdate": "config_option_update", "configOptions": _config_options(rec)})
        return {"configOptions": _config_options(rec)}

    # -- turns ---------------------------------------------------------------

    async def prompt(self, params: Params) -> dict[str, Any]:
        session_id, blocks = _str_param(params, "sessionId"), params.get("prompt")
        if not isinstance(blocks, list):
            raise RpcError.invalid_params({"prompt": blocks, "details": "prompt must be a list of content blocks"})
        text = "".join(b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                       and isinstance(b.get("text"), str))
        log.info("session/prompt session=%s text=%r", session_id, text)
        rec = self._session(session_id)
        if session_id in self._turns:
            raise RpcError.invalid_request({"details": "a prompt is already running in this session"})
        cancel = self._turns[session_id] = asyncio.Event()
        try:
            rec.append("user", text)
            return {"stopReason": await self._run_script(rec, text, cancel)}
        finally:
            del self._turns[session_id]

    async def cancel(self, params: Params) -> None:
        session_id = params.get("sessionId")
        log.info("session/cancel session=%s running=%s", session_id, session_id in self._turns)
        if isinstance(session_id, str) and (turn := self._turns.get(session_id)):
            turn.set()

    async def _run_script(self, rec: SessionRecord, text: str, cancel: asyncio.Event) -> StopReason:
        command, *args = text.split() or [""]
        number = _int_arg(args)
        if command in ("/slow", "/flood") and number is not None and number >= 0:
            return await self._stream(rec, number, SLOW_INTERVAL if command == "/slow" else 0.0, cancel)
        if command == "/silent" and number is not None and number >= 0:
            with contextlib.suppress(TimeoutError):
                await within(cancel.wait(), number)
            if cancel.is_set():
                return "cancelled"
            await self._say(rec, f"silent: {number} s")
            return "end_turn"
        if command == "/hang" and number is not None and number >= 0:
            await asyncio.sleep(number)  # a cancel is logged and ignored
            await self._say(rec, f"hang: {number} s")
            return "end_turn"
        if command == "/permission" and not args:
            return await self._ask_permission(rec, cancel)
        if command == "/fail" and not args:
            raise RpcError.internal_error({"details": "mock /fail"})
        if command == "/exit" and number is not None and 0 <= number <= 255:
            await self._say(rec, f"exiting {number}")  # written to the pipe once this returns
            log.info("/exit: exiting %d", number)
            os._exit(number)
        if command == "/git-credential" and not args:
            await self._say(rec, await _git_credential(rec.cwd))
            return "end_turn"
        if command == "/alloc" and number is not None and number >= 0:
            await asyncio.to_thread(_allocate, number)
            await self._say(rec, f"alloc: {number} MiB")
            return "end_turn"
        if command == "/stderr" and number is not None and number >= 0:
            await asyncio.to_thread(_write_stderr, number)
            await self._say(rec, f"stderr: wrote {number}")
            return "end_turn"
        if command == "/sh" and args:
            said, cancelled = await _shell(text.strip()[len("/sh"):].strip(), rec.cwd, cancel)
            await self._say(rec, said)
            return "cancelled" if cancelled else "end_turn"
        await self._say(rec, f"echo: {text}")
        return "end_turn"

    async def _stream(self, rec: SessionRecord, n: int, interval: float, cancel: asyncio.Event) -> StopReason:
        for i in range(1, n + 1):
            if cancel.is_set():
                return "cancelled"
            await self._say(rec, f"{i}/{n} ")
            if interval:
                with contextlib.suppress(TimeoutError):
                    await within(cancel.wait(), interval)
        return "cancelled" if cancel.is_set() else "end_turn"

    async def _ask_permission(self, rec: SessionRecord, cancel: asyncio.Event) -> StopReason:
        tool_call = {"toolCallId": f"mock-permission-{uuid.uuid4().hex[:8]}", "title": "mock permission",
                     "kind": "other"}
        response = await self.wire.request(
            "session/request_permission",
            {"sessionId": rec.session_id, "toolCall": tool_call, "options": PERMISSION_OPTIONS},
        )
        outcome = response.get("outcome") if isinstance(response, dict) else None
        if isinstance(outcome, dict) and outcome.get("outcome") == "selected":
            answer = str(outcome.get("optionId"))
        else:
            answer = "cancelled"
        await self._say(rec, f"permission: {answer}")
        return "cancelled" if cancel.is_set() or answer == "cancelled" else "end_turn"


async def _serve() -> None:
    agent = MockAgent()
    requests, notifications = agent.handlers()
    wire = await stdio_wire(requests, notifications)
    agent.connect(wire)
    await wire.serve()


async def _git_credential(cwd: str) -> str:
    """The session's git lease for ``origin`` of the repository at ``cwd``, checked with its
    credential endpoint (no credential is handed out: Issue 20). Reports a digest, never the lease."""
    from daemon.credentials.scope import parse_remote_url
    from daemon.git_credential_helper import LEASE_FILE_ENV, SOCKET_ENV, HelperError, valid_lease

    env = dict(os.environ)
    code, out, err = await _git(cwd, env, "config", "--get", "remote.origin.url")  # as written, not rewritten
    if code != 0:
        return f"git-credential: failed: git exit {code}: {_first_line(err)}"
    scope = parse_remote_url(out.strip())
    if scope is None or not env.get(LEASE_FILE_ENV) or not env.get(SOCKET_ENV):
        return "git-credential: failed: no kandev git lease for this repository"
    try:
        token = await asyncio.to_thread(valid_lease, env[LEASE_FILE_ENV], env[SOCKET_ENV], scope.host,
                                        f"{scope.repository}.git")
    except HelperError as exc:
        return f"git-credential: failed: {exc.code}: {_first_line(exc.message)}"
    digest = hashlib.sha256(token.encode()).hexdigest()[:12]
    return f"git-credential: ok repository={scope} lease-sha256={digest}"


async def _git(cwd: str, env: dict[str, str], *args: str, stdin: str = "") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "git", *args, cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await within(proc.communicate(stdin.encode()), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, "", "git did not finish within 30 s"
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


SH_OUTPUT_LIMIT = 4096
SH_KILL_GRACE = 2.0
"""Seconds a cancelled /sh command's group has to end after SIGTERM (then SIGKILL), and after SIGKILL."""
SH_READ_GRACE = 0.2
"""Seconds the output is still read once the group is gone."""


_HELD: list[bytearray] = []  # what /alloc allocated: kept for the life of the process


def _allocate(mib: int) -> None:
    """Allocate ``mib`` MiB and touch every page of it, so the memory is really used."""
    for _ in range(mib):
        block = bytearray(1 << 20)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        _HELD.append(block)


def _write_stderr(total: int) -> None:
    """``total`` bytes of 1 KiB lines of "x" to fd 2 (blocking: the agent waits on a full pipe)."""
    line = b"x" * 1023 + b"\n"
    left = total
    while left > 0:
        chunk = (line * 64)[: min(left, 64 * 1024)]
        left -= os.write(2, chunk)


async def _shell(command: str, cwd: str, cancel: asyncio.Event) -> tuple[str, bool]:
    """``sh -c command`` in ``cwd``, in a process group of its own (as a shell's job control or a
    terminal tool starts each command): ``("sh: exit=<code>\n<first 4 KiB of stdout+stderr>",
    cancelled)``. The rest of the output is read and dropped, so the command never blocks on a full
    pipe. A cancel ends the whole group (SIGTERM, then SIGKILL), what ``sh`` put in the background
    included; a process that left the group (``setsid``) is the control server's to end."""
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", command, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )
    assert proc.stdout is not None
    kept = bytearray()

    async def read_all() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            if len(kept) < SH_OUTPUT_LIMIT:
                kept.extend(chunk[: SH_OUTPUT_LIMIT - len(kept)])
        await proc.wait()

    reader = asyncio.ensure_future(read_all())
    cancelled = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait([reader, cancelled], return_when=asyncio.FIRST_COMPLETED)
        if not reader.done():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                _signal_group(proc.pid, sig)
                with contextlib.suppress(TimeoutError):
                    await within(_group_gone(proc.pid), SH_KILL_GRACE)
                if not _group_exists(proc.pid):
                    break
            # The group is gone: whatever still holds the pipe left it (setsid); stop reading.
            with contextlib.suppress(TimeoutError):
                await within(asyncio.shield(reader), SH_READ_GRACE)
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                with contextlib.suppress(TimeoutError):
                    await within(proc.wait(), SH_KILL_GRACE)
    finally:
        cancelled.cancel()
    output = kept.decode("utf-8", errors="replace")
    return f"sh: exit={proc.returncode}\n{output}", cancel.is_set()


def _signal_group(pgid: int, sig: int) -> None:
    """Signal the command's process group (its id is sh's pid: no other group takes it while one
    of its members lives, even once sh itself is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _group_gone(pgid: int) -> None:
    while _group_exists(pgid):
        await asyncio.sleep(0.05)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")[:300]


def main() -> None:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s kandev-mock[%(process)d] %(message)s"
    )
    log.info("start cwd=%s switches=%s", os.getcwd(), read_switches(os.getcwd()))
    asyncio.run(_serve())
    log.info("stdin closed: exiting")


if __name__ == "__main__":
    main()

