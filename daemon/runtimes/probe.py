"""The ACP capability probe of a candidate runtime (RESUME-11: success only once ACP init passed).

The candidate is started exactly as a launch starts it (the built-in argv:
``npx --yes --prefer-offline <pkg>@<ver> <acp args>``), in its own process
group, and spoken to with the ``acp`` SDK's client connection: ``initialize``
only, within a time limit. Whatever happens, the whole process group is then
stopped. The probe passes when the agent answers ``initialize`` with the
protocol version this kandev speaks (``acp.PROTOCOL_VERSION``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from daemon.core.version import VERSION
from daemon.runtimes.proc import DETAIL_LIMIT, Confine, ConfineError, confined, drain, sanitize, stop_group
from ipc.aio import within

CLIENT_NAME = "kandev-runtime-probe"
CLIENT_VERSION = VERSION
STDOUT_LIMIT = 16 * 1024 * 1024  # one JSON-RPC line may be large
STDERR_KEEP = 8 * 1024


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    protocol_version: int | None = None
    agent_name: str | None = None
    agent_version: str | None = None
    detail: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ProbeClient:
    """The client side of a connection that only ever sends ``initialize``."""

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        return None

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        import acp

        raise acp.RequestError.method_not_found("session/request_permission")


def _import_sdk() -> None:
    """The ACP SDK, imported only by a probe: the backend's start does not pay for its ~270
    pydantic models (most of a second of CPU), and a probe imports it once, off the event loop."""
    import acp.schema  # noqa: F401


async def acp_probe(
    argv: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], timeout: float, confine: Confine | None = None
) -> ProbeResult:
    """Start ``argv`` (confined as ``confine`` says, if given), send ACP ``initialize``, stop the
    process group; never raises for the agent's faults."""
    await asyncio.to_thread(_import_sdk)
    import acp
    from acp.schema import ClientCapabilities, Implementation

    start = time.monotonic()
    try:
        how = await confined(confine, argv, env)
    except ConfineError as exc:
        return ProbeResult(False, detail=sanitize(f"cannot start {argv[0]}: {exc}"), duration_s=0.0)
    try:
        proc = await asyncio.create_subprocess_exec(
            *how.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(cwd),
            env=how.env,
            start_new_session=True,
            limit=STDOUT_LIMIT,
            pass_fds=how.fds,
        )
    except OSError as exc:
        return ProbeResult(False, detail=sanitize(f"cannot start {argv[0]}: {exc}"), duration_s=0.0)
    finally:
        how.close()
    stderr_task = asyncio.create_task(drain(proc.stderr, STDERR_KEEP))
    assert proc.stdin is not None and proc.stdout is not None
    conn = acp.connect_to_agent(_ProbeClient(), proc.stdin, proc.stdout)  # type: ignore[arg-type]  # partial acp.Client
    result: ProbeResult
    try:
        init = await within(
            conn.initialize(
                protocol_version=acp.PROTOCOL_VERSION,
                client_capabilities=ClientCapabilities(),
                client_info=Implementation(name=CLIENT_NAME, version=CLIENT_VERSION),
            ),
            timeout,
        )
    except TimeoutError:
        reason = f"no answer to initialize within {timeout:g} s"
        result = ProbeResult(False, detail=reason)
    except Exception as exc:  # the agent refused, or went away before answering
        reason = f"initialize failed: {type(exc).__name__}: {exc}"
        result = ProbeResult(False, detail=reason)
    else:
        info = init.agent_info
        version = int(init.protocol_version)
        ok = version == acp.PROTOCOL_VERSION
        result = ProbeResult(
            ok,
            protocol_version=version,
            agent_name=getattr(info, "name", None),
            agent_version=getattr(info, "version", None),
            detail="" if ok else f"the agent speaks ACP protocol version {version}, not {acp.PROTOCOL_VERSION}",
        )
    finally:
        await stop_group(proc)
        with contextlib.suppress(Exception):
            await conn.close()
    try:
        err = await within(stderr_task, 2.0)
    except (TimeoutError, Exception):
        stderr_task.cancel()
        err = b""
    detail = result.detail
    if not result.ok:
        if proc.returncode is not None and proc.returncode >= 0:
            detail += f"; exit code {proc.returncode}"
        tail = sanitize(err.decode("utf-8", "replace"), DETAIL_LIMIT // 2)
        if tail:
            detail += f"; stderr: {tail}"
    return ProbeResult(
        result.ok,
        result.protocol_version,
        result.agent_name,
        result.agent_version,
        sanitize(detail),
        round(time.monotonic() - start, 3),
    )
