"""Backend ops of the git credential broker (``api.CREDENTIAL_OPS``; daemon/credentials).

``credential_redeem`` (a check of a lease: its answer holds no credential, Issue 20) and
``credential_reissue`` are what the agent's git transport calls on its session's endpoint, and
also answered on the backend socket whose peers are admitted by ``SO_PEERCRED`` (same uid, root or the
service group). There is deliberately no op that *issues* a lease from nothing: leases are
issued inside the backend by the launch/resume flow (``daemon.credentials.issue_lease``), only a
holder of a lease's reissue capability can get a new one over the socket.

The broker runs in a worker thread with its own store session (it reads the token file and may
run ``git config --file``); refusals are typed errors with the broker's stable codes
(``session_terminal``, ``lease_expired``, ``lease_revoked``, ``lease_invalid``, ``scope_denied``,
``credentials_unavailable``, ``capability_invalid``, ``not_found``). Neither the request's lease
token nor the capability is ever logged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from daemon.credentials import ensure_signing_key, redeem_lease, reissue_lease
from daemon.credentials.errors import off_loop_handler
from ipc.server import ConnectionContext

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]


def handlers(backend: BackendContext) -> dict[str, Handler]:
    """The op handlers. Creating them also creates the signing key if this home has none yet, so
    a start without OS randomness fails before any launch (LEASE-CTX-5)."""
    ensure_signing_key(backend.store.engine)
    config = backend.config.credentials

    def _redeem(args: dict[str, Any]) -> dict[str, Any]:
        with backend.store.session() as db:
            r = redeem_lease(db, args["lease_token"], args["host"], args["path"], config=config,
                             protocol=args.get("protocol") or "https")
            # A check only (Issue 20): the upstream token is used by the git endpoint, never handed out.
            return {"lease_id": r.lease_id, "host": r.host, "repository": r.repository, "expires_at": r.expires_at}

    def _reissue(args: dict[str, Any]) -> dict[str, Any]:
        with backend.store.session() as db:
            token, lease_id = reissue_lease(db, args["capability"], config=config)
            return {"lease_token": token, "lease_id": lease_id}

    return {"credential_redeem": off_loop_handler(_redeem), "credential_reissue": off_loop_handler(_reissue)}
