"""The built-in ``hello`` op: its name and the client-side version check (its declaration,
``HELLO_OP``, is the server's: ``ipc.server``).

Every kandev socket answers ``hello`` (no authentication) with its protocol
name, ``[major, minor]`` version, capability set and op names. Both sides
refuse a different major version with ``incompatible_version``: the server
when it reads the request, the client again when it reads the answer.
"""

from __future__ import annotations

from .errors import ErrorCode, IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

HELLO = "hello"


def check_hello(result: Any, protocol_major: int, where: str) -> dict[str, Any]:
    """Validate a hello result and refuse a server of another major version."""
    if not isinstance(result, dict):
        raise IpcError(ErrorCode.INVALID_FRAME, f"malformed hello answer from {where}")
    version = result.get("version")
    if (
        not isinstance(version, list)
        or len(version) < 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in version[:2])
    ):
        raise IpcError(ErrorCode.INVALID_FRAME, f"malformed hello answer from {where}")
    if version[0] != protocol_major:
        raise IpcError(
            ErrorCode.INCOMPATIBLE_VERSION,
            f"{where} speaks {result.get('protocol')!s:.60} {version[0]}.{version[1]}; "
            f"this client speaks major {protocol_major}",
        )
    return result
