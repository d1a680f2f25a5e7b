"""Bounded subprocess runs for the runtime jobs, and the sanitizer for what they report.

Every command is a direct argv (never a shell), runs in its own process group
(so npm and the node processes it starts are killed together), with stdin
closed, a time limit, and at most ``OUTPUT_LIMIT`` bytes kept of each output
stream (the tail: npm prints its error last).

A runner given a ``Confine`` runs each command as it says (``Confined``: the argv that runs it in
the preparation sandbox, its environment and the descriptors that argv inherits, closed here once
the command started); the backend's ``daemon.backend.sessions.runtime_sandbox`` makes one per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ipc.aio import within

OUTPUT_LIMIT = 64 * 1024
DETAIL_LIMIT = 1500
KILL_GRACE_S = 2.0

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_REDACTIONS = (
    # registry credentials in .npmrc style or in environment-variable style
    (re.compile(r"(?i)(_authToken|_auth|_password|npm_token|token|password|secret)(\s*[=:]\s*)\S+"), r"\1\2<redacted>"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 <redacted>"),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+(?::[^/\s@]*)?@"), r"\1<redacted>@"),
)


def sanitize(text: str, limit: int = DETAIL_LIMIT) -> str:
    """One bounded, printable line-oriented text: escapes and control characters removed, credentials
    redacted, blank lines dropped, and at most ``limit`` characters (head and tail, joined by ``…``)."""
    text = _ANSI.sub("", text or "")
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    for pattern, repl in _REDACTIONS:
        text = pattern.sub(repl, text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(line for line in lines if line.strip())
    if len(text) > limit:  # keep the head (what failed) and the tail (npm prints its error last)
        head = max(limit // 3, 1)
        text = text[:head] + "…" + text[-(limit - head - 1):]
    return text


@dataclass(frozen=True)
class Confined:
    """How one command runs confined: its argv, its environment, the descriptors it inherits."""

    argv: tuple[str, ...]
    env: dict[str, str]
    fds: tuple[int, ...] = field(default=())

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class ConfineError(Exception):
    """The command cannot be confined (no sandbox here); the message says why."""


Confine = Callable[[Sequence[str], Mapping[str, str]], Awaitable[Confined]]
"""``(argv, env) -> Confined``: the command wrapped in the preparation sandbox (ConfineError: cannot)."""


async def confined(confine: Confine | None, argv: Sequence[str], env: Mapping[str, str]) -> Confined:
    """``argv`` as ``confine`` runs it, or as it is without one."""
    if confine is None:
        return Confined(tuple(argv), dict(env))
    return await confine(argv, env)


@dataclass(frozen=True)
class RunResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: did not start, or was killed at the time limit
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    error: str | None = None  # why it did not start

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.error is None

    def failure(self, limit: int = DETAIL_LIMIT) -> str:
        """Why it failed, bounded and sanitized."""
        if self.error is not None:
            return sanitize(self.error, limit)
        if self.timed_out:
            head = f"timed out after {self.duration_s:.0f} s"
        else:
            head = f"exit code {self.returncode}"
        tail = sanitize(self.stderr or self.stdout, max(limit - len(head) - 2, 100))
        return f"{head}: {tail}" if tail else head


async def drain(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """Read to EOF, keeping the last ``limit`` bytes."""
    if stream is None:
        return b""
    kept = bytearray()
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(kept)
        kept += chunk
        if len(kept) > limit:
            del kept[: len(kept) - limit]


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group ``pid`` leads (it was started with ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def stop_group(proc: asyncio.subprocess.Process, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the group, SIGKILL it after ``grace`` seconds, and reap the leader."""
    if proc.returncode is None:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            await within(asyncio.shield(proc.wait()), grace)
        except TimeoutError:
            pass
    kill_group(proc.pid, signal.SIGKILL)  # also whatever the leader left behind in its group
    with contextlib.suppress(TimeoutError):
        await within(asyncio.shield(proc.wait()), grace)


# What a runtime job writes (npm's cache and the prepared trees) is public package code that agents
# run, as another uid when kandev runs as root (daemon/host/agent_user.py): never private, whatever the
# daemon's own umask (077). Nothing secret goes through these commands.
RUNTIME_UMASK = 0o022


class CommandRunner:
    """Runs direct-argv commands in ``cwd`` with ``env`` (default: this process's environment), with
    the umask ``umask``."""

    def __init__(self, cwd: Path | str, env: Mapping[str, str] | None = None, output_limit: int = OUTPUT_LIMIT,
                 umask: int = RUNTIME_UMASK, confine: Confine | None = None):
        self.cwd = str(cwd)
        self.env = dict(os.environ if env is None else env)
        self.output_limit = output_limit
        self.umask = umask
        self.confine = confine

    async def run(self, argv: Sequence[str], timeout: float) -> RunResult:
        argv = tuple(argv)
        start = time.monotonic()
        if shutil.which(argv[0], path=self.env.get("PATH", os.defpath)) is None:
            return RunResult(argv, None, "", "", False, time.monotonic() - start,
                             f"cannot run {argv[0]}: not found on the PATH")
        try:
            how = await confined(self.confine, argv, self.env)
        except ConfineError as exc:
            return RunResult(argv, None, "", "", False, time.monotonic() - start, f"cannot run {argv[0]}: {exc}")
        try:
            # the umask through sh (the event loop's subprocess_exec takes none; the argv stays direct:
            # sh only sets it and execs "$@")
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", f'umask {self.umask:03o} && exec "$@"', "sh", *how.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.cwd,
                env=how.env,
                start_new_session=True,
                pass_fds=how.fds,
            )
        except OSError as exc:
            return RunResult(argv, None, "", "", False, time.monotonic() - start, f"cannot run {argv[0]}: {exc}")
        finally:
            how.close()
        reads = asyncio.gather(drain(proc.stdout, self.output_limit), drain(proc.stderr, self.output_limit))
        timed_out = False
        try:
            out, err = await within(asyncio.shield(reads), timeout)
            await within(proc.wait(), KILL_GRACE_S)
        except TimeoutError:
            timed_out = True
            await stop_group(proc)
            try:
                out, err = await within(reads, KILL_GRACE_S)
            except TimeoutError:  # something outside the group still holds the pipes
                out, err = b"", b""
        except BaseException:  # cancelled: never leave npm running behind us
            await stop_group(proc)
            reads.cancel()
            raise
        else:
            kill_group(proc.pid)  # nothing of the group outlives the command
        return RunResult(
            argv,
            None if timed_out else proc.returncode,
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            timed_out,
            time.monotonic() - start,
        )
