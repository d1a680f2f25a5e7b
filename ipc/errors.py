"""Typed errors that cross the wire.

Every refusal a kandev socket sends is an ``IpcError`` with a stable string
``code`` (never renamed: backend N talks to control server N-1), a human
message, and whether retrying the same request later may succeed. A few codes
also carry ``details``, a map for programs (e.g. the ``candidates`` of an
``ambiguous_id``); it is on the wire only when set, and readers that do not
know it ignore it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any



class ErrorCode:
    """Stable error codes. Add new ones; never rename or reuse one."""

    INVALID_FRAME = "invalid_frame"  # not msgpack, not a map, bad envelope
    FRAME_TOO_LARGE = "frame_too_large"  # length prefix above the limit
    UNKNOWN_OP = "unknown_op"
    INVALID_ARGUMENT = "invalid_argument"  # missing or mistyped field
    INCOMPATIBLE_VERSION = "incompatible_version"  # protocol major differs
    PERMISSION_DENIED = "permission_denied"  # peer uid/gid not admitted
    UNAUTHENTICATED = "unauthenticated"  # op needs an authenticated connection
    SUPERSEDED_CREDENTIAL = "superseded_credential"
    UNKNOWN_ROTATION = "unknown_rotation"  # confirm_rotation of an id the server never issued
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # state changed underneath (compare-and-set lost)
    SESSION_GUARDED = "session_guarded"  # recovery holds this session
    SHUTTING_DOWN = "shutting_down"
    UNAVAILABLE = "unavailable"  # peer unreachable / connection lost
    TIMEOUT = "timeout"
    AGENT_ERROR = "agent_error"  # the agent refused or failed the request
    INTERNAL = "internal"
    BUFFERS_FULL = "buffers_full"  # the server's receive buffers (all connections together) are at their cap
    IDLE_TIMEOUT = "idle_timeout"  # the server closed a connection that sent no request for too long
    AMBIGUOUS_ID = "ambiguous_id"  # an id prefix matches more than one object (details: candidates)
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"  # agents.sandbox = required, and no agent sandbox can be made
    RUNTIME_NOT_PREPARED = "runtime_not_prepared"  # a sandboxed npm agent whose runtime was never prepared
    RELOADING = "reloading"  # the server is re-executing (hand-over): the request was never run; send it again
    WORKSPACE_NOT_WRITABLE = "workspace_not_writable"  # the uid agents run as cannot write the workspace given


_RETRYABLE_BY_DEFAULT = frozenset(
    {
        ErrorCode.UNAVAILABLE,
        ErrorCode.TIMEOUT,
        ErrorCode.SESSION_GUARDED,
        ErrorCode.BUFFERS_FULL,
        ErrorCode.IDLE_TIMEOUT,
        ErrorCode.RELOADING,
    }
)


class IpcError(Exception):
    """An error with a stable code, safe to send to a peer."""

    def __init__(
        self, code: str, message: str, retryable: bool | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = code in _RETRYABLE_BY_DEFAULT if retryable is None else retryable
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default reduce replays self.args (the formatted text),
        # which does not fit __init__: keep copy/pickle working.
        return (type(self), (self.code, self.message, self.retryable, self.details))

    def copy(self) -> IpcError:
        """A fresh exception with the same code, message and retryability: one error handed to
        many waiters is raised as a copy each, never as one shared instance."""
        return IpcError(self.code, self.message, self.retryable)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.details is not None:
            wire["details"] = self.details
        return wire

    @classmethod
    def from_wire(cls, error: Any) -> IpcError:
        if not isinstance(error, dict):
            return cls(ErrorCode.INVALID_FRAME, f"malformed error object: {error!r:.200}")
        details = error.get("details")
        return cls(
            str(error.get("code", ErrorCode.INTERNAL)),
            str(error.get("message", "")),
            bool(error.get("retryable", False)),
            details if isinstance(details, dict) else None,
        )


class RequestNotSent(IpcError):
    """The connection was closed before the request was written (the send failed): the server
    never read a whole frame of it, so it ran nothing, and asking again on a new connection cannot
    run it twice (``unavailable``, retryable)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message, True)
