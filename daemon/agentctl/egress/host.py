"""The control server's egress proxies: one per sandboxed instance, opened at its spawn, closed with it,
carried across a re-exec.

``EgressHost.open`` reads the instance's network policy (``create_instance``'s ``network`` field,
``daemon.agents.network.NetworkPolicy``; absent: the allow-list with the agent's built-in provider
hosts), makes its proxy endpoint (``daemon.agentctl.egress.listener.SessionEgress``: a Unix socket in
``<run>/egress/<instance id>/``) unless the mode is ``"none"``, records both in the instance's spec
(``InstanceSpec.network``, which a re-exec hands over) and returns what its sandbox needs
(``daemon.agentctl.sandbox.network.SandboxNet``). ``restore`` opens the endpoint again in the next
process image from the spec; ``close`` ends it with its instance; ``stats`` and ``totals`` are the
refusals ``list_instances``, ``network_status`` and so ``session show`` and ``status`` report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Callable
from typing import Any

from daemon.agentctl.egress.listener import SOCKET_NAME, SessionEgress
from daemon.agents.network import NetworkPolicy, RuleError, effective_policy
from daemon.agents.registry import BUILTIN_AGENTS
from daemon.host.agent_user import AgentUserMissing, agent_user

log = logging.getLogger("kandev.agentctl.egress")

EGRESS_DIR = "egress"
RECENT_TOTAL = 5


def default_policy(agent: str | None) -> NetworkPolicy:
    """The policy of a launch that names none: the allow-list with the agent's own provider hosts."""
    builtin = BUILTIN_AGENTS[agent].allow_hosts if agent in BUILTIN_AGENTS else ()
    return effective_policy("allow-list", (), (), agent or "", builtin)


class EgressHost:
    """Every instance's egress proxy of one control server (see the module docstring)."""

    def __init__(self, run_dir: str) -> None:
        self.root = os.path.join(run_dir, EGRESS_DIR)
        self.sessions: dict[str, SessionEgress] = {}

    @staticmethod
    def policy(agent: str | None, wire: Any) -> NetworkPolicy:
        """The instance's policy from ``create_instance``'s ``network`` (RuleError naming the field)."""
        if wire is None:
            return default_policy(agent)
        return NetworkPolicy.from_wire(wire, agent or "")

    def _ids(self) -> tuple[int | None, int | None]:
        try:
            user = agent_user()
        except AgentUserMissing:
            return None, None
        return user.uid, user.gid

    async def open(self, instance_id: str, session_id: str, agent: str | None, policy: NetworkPolicy) -> str | None:
        """The instance's proxy socket (None for mode ``"none"``: no way out), listening."""
        if not policy.proxied:
            return None
        path = os.path.join(self.root, instance_id, SOCKET_NAME)
        egress = SessionEgress(instance_id, session_id, agent or "", policy, path)
        uid, gid = self._ids()
        await asyncio.to_thread(egress.bind, uid, gid)
        egress.start()
        self.sessions[instance_id] = egress
        return path

    def record(self, instance_id: str, policy: NetworkPolicy, path: str | None) -> dict[str, Any]:
        """What the instance's spec keeps of its network (``InstanceSpec.network``)."""
        egress = self.sessions.get(instance_id)
        return {"policy": policy.to_wire(), "socket": path,
                "stats": egress.stats() if egress is not None else {"mode": policy.mode, "refused": 0}}

    def sync(self, instance_id: str, record: dict[str, Any] | None) -> None:
        """Bring the instance's record up to date (its refusals) before a re-exec captures it."""
        egress = self.sessions.get(instance_id)
        if record is not None and egress is not None:
            record["stats"] = egress.stats()

    async def restore(self, instance_id: str, session_id: str, agent: str | None, record: Any) -> None:
        """The next process image: the instance's endpoint again, at the path its sandbox binds."""
        if not isinstance(record, dict) or not isinstance(record.get("socket"), str):
            return
        try:
            policy = NetworkPolicy.from_wire(record.get("policy"), agent or "")
        except RuleError as exc:
            log.error("instance %s: its network policy cannot be read back (%s): its agent has no way out",
                      instance_id, exc)
            return
        path = record["socket"]
        if os.path.dirname(os.path.dirname(path)) != self.root:
            log.error("instance %s: its proxy socket %s is not under %s: not opened", instance_id, path, self.root)
            return
        egress = SessionEgress(instance_id, session_id, agent or "", policy, path)
        egress.restore_stats(record.get("stats"))
        uid, gid = self._ids()
        try:
            await asyncio.to_thread(egress.bind, uid, gid)
        except OSError as exc:
            log.error("instance %s: cannot open its proxy socket again: %s", instance_id, exc)
            return
        egress.start()
        self.sessions[instance_id] = egress

    def log_to(self, instance_id: str, note: Callable[[str], None]) -> None:
        """Where the instance's refusals are also written: a line among its agent's stderr."""
        egress = self.sessions.get(instance_id)
        if egress is not None:
            egress.note = note

    async def close(self, instance_id: str) -> None:
        egress = self.sessions.pop(instance_id, None)
        if egress is not None:
            await egress.close()

    async def close_all(self, *, remove: bool = True) -> None:
        for instance_id in list(self.sessions):
            egress = self.sessions.pop(instance_id)
            await egress.close(remove=remove)

    def stats(self, instance_id: str) -> dict[str, Any] | None:
        egress = self.sessions.get(instance_id)
        return egress.stats() if egress is not None else None

    def totals(self) -> dict[str, Any]:
        """Every instance's refusals: the count and the last few destinations (newest last)."""
        recent = sorted((r for e in self.sessions.values() for r in e.recent), key=lambda r: r.at)[-RECENT_TOTAL:]
        owners = {id(r): e.session_id for e in self.sessions.values() for r in e.recent}
        return {"refused": sum(e.refused_count for e in self.sessions.values()),
                "recent_refused": [{**r.to_wire(), "session_id": owners.get(id(r))} for r in recent]}

    def prune(self, keep: set[str]) -> None:
        """Remove directories of instances no server serves (a server that died left them): those not
        in ``keep`` whose socket answers nobody. Blocking; at start."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if name in keep:
                continue
            path = os.path.join(self.root, name, SOCKET_NAME)
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                continue  # another control server's (the passthrough one shares the run directory)
            except ConnectionRefusedError:
                pass  # a socket nobody listens on: its server is gone
            except OSError:
                continue  # no socket (yet): leave it alone
            finally:
                probe.close()
            with contextlib.suppress(OSError):
                shutil.rmtree(os.path.join(self.root, name))
