"""Handler of ``session_resume`` (``kandev resume SID [--fresh]``; ``api.RESUME_OPS``).

The work, and the rules it keeps (RESUME-1, RESUME-2, RESUME-3, RESUME-4, RESUME-5, RESUME-6, RESUME-7, RESUME-8, RESUME-9, RESUME-10), is ``daemon.backend.sessions.resume``.
"""

from __future__ import annotations

from typing import Any

from daemon.backend.sessions.resume import ResumeService
from ipc.server import ConnectionContext, Handler


def handlers(resume: ResumeService) -> dict[str, Handler]:
    async def op_session_resume(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await resume.resume(args["session_id"], fresh=bool(args.get("fresh", False)))

    return {"session_resume": op_session_resume}
