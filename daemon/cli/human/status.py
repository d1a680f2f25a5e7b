"""``kandev status`` for people, in the manner of ``systemctl status``.

A headline (state, pid, version), then warnings, then one labelled block per part: survival
capability, control server (its link state, the running and installed versions, re-executions in
place), adoption, recovery. The backend adds fields over time (and other
features add sections): every field this module does not know is still shown, under its part,
as ``name: value``; a part it does not know gets a block of its own. Nothing is dropped.
"""

from __future__ import annotations

from daemon.api.ops import AdoptionOutcome, BackendState, LinkObserved, LinkState
from daemon.cli.human.fmt import (
    duration_ms,
    network_refusals,
    out_of_space_line,
    short,
    unreachable_line,
    when,
)
from daemon.cli.human.term import Term

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

LABEL = 15  # label column width (right-aligned, as systemctl does)

_KNOWN = {
    "backend": {"pid", "version", "socket", "home", "state", "config"},
    "capability": {"state", "reason", "detail", "supervisor", "auto_resume"},
    "control_server": {"state", "pid", "version", "server_identity", "endpoint", "mode", "log_path",
                       # versions and re-execution in place (Issue 15): shown by _version_lines
                       "installed_version", "protocol_version", "can_reload", "reexec_count", "last_reexec_at",
                       "last_reload", "replacement", "last_replaced",
                       # the backend's link to it: losses, restarts, the crash loop (shown by _link_lines)
                       "last_loss", "losses_in_window", "crash_loop", "gave_up", "restarts", "replacements",
                       "passthrough"},
    "recovery": {"retracked", "not_retracked", "reasons", "stopped_orphans", "duration_ms", "without_agent",
                 "stopped_with_backend", "stopped_without_agent"},
    "adoption": {"outcome", "reason"},
}
_ORDER = ("backend", "capability", "control_server", "adoption", "recovery")
# reloading: re-executing in place for a moment; replacing: the backend retires a server too old to
# reload for one of the installed version (neither is a loss)
# reloading: how ``status`` shows a running server that re-executes (not a state of its link)
_HEALTHY_SERVER = {LinkState.RUNNING, LinkState.NONE, LinkObserved.RELOADING, LinkState.REPLACING}


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_value(v) for v in value) if value else "-"
    return str(value)


def _flatten(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        pairs: list[tuple[str, str]] = []
        for key, inner in value.items():
            pairs += _flatten(f"{prefix}.{key}" if prefix else str(key), inner)
        return pairs
    if value is None:
        return []
    return [(prefix, _value(value))]


def _extras(section: dict[str, Any], known: set[str]) -> list[str]:
    """``name: value`` for every field of ``section`` not in ``known`` (nested maps flattened)."""
    pairs: list[tuple[str, str]] = []
    for key, value in section.items():
        if key not in known:
            pairs += _flatten(str(key), value)
    return [f"{name}: {text}" for name, text in pairs]


def warnings(status: dict[str, Any]) -> list[str]:
    """What needs a person's attention, most important first."""
    out: list[str] = []
    backend = status.get("backend") or {}
    if backend.get("state") not in (None, BackendState.READY):
        out.append(f"the backend is {backend.get('state')}, not ready yet")
    cap = status.get("capability") or {}
    if cap.get("state") == "unavailable":
        out.append(f"agent survival is unavailable ({cap.get('reason')}): {cap.get('detail')}")
    server = status.get("control_server") or {}
    state = server.get("state")
    if state is not None and state not in _HEALTHY_SERVER:
        out.append(f"the control server is {state}")
    out += _version_warnings(server)
    recovery = status.get("recovery") or {}
    # the sessions the start could not re-track that still have no agent (resumed ones are fine)
    missed = int(recovery.get("without_agent", recovery.get("not_retracked")) or 0)
    if missed:
        out.append(f"{missed} session{'s' if missed != 1 else ''} could not be re-tracked at the last start and"
                   f" still {'have' if missed != 1 else 'has'} no agent (`kandev resume SESSION` gives one an agent"
                   " again)")
    adoption = status.get("adoption") or {}
    if adoption.get("outcome") == AdoptionOutcome.REFUSED:
        out.append(f"the control server could not be adopted: {adoption.get('reason')}")
    store = status.get("store") or {}
    if store.get("reachable") is False:
        out.append(unreachable_line(store.get("unreachable") or {}))
    full = store.get("out_of_space")
    if full:
        out.append(out_of_space_line(full))
    cluster = status.get("cluster") or {}
    for host in cluster.get("unreachable") or []:
        out.append(f"cluster host {host.get('name')} is unreachable since {when(host.get('since'))}: its sessions show"
                   " their last known state")
    sandbox = status.get("sandbox") or {}
    if sandbox.get("sandboxed") is False:
        out.append(f"agents are not sandboxed: {sandbox.get('reason') or 'unknown'}")
    memory = status.get("memory") or {}
    if memory.get("bounded") is False:
        out.append(f"agents' memory is unbounded (agents.max_memory is not enforced): {memory.get('reason') or 'unknown'}")
    return out


def _version_warnings(server: dict[str, Any]) -> list[str]:
    running, installed = server.get("version"), server.get("installed_version")
    if server.get("replacement") == "when_idle":
        return [f"the control server predates in-place reload: version {installed or '?'} replaces it once it"
                " runs no instance (end or stop its sessions to have that sooner)"]
    if server.get("can_reload") and running and installed and running != installed:
        last = server.get("last_reload") or {}
        why = f" (the last reload was refused: {last.get('reason')})" if last.get("outcome") == "refused" else ""
        return [f"the control server runs version {running}, {installed} is installed{why}:"
                " `kandev agentctl reload` runs it"]
    return []


def _version_lines(server: dict[str, Any]) -> list[str]:
    """The running and installed versions and what happened in place: re-executions, the last
    reload's outcome, a replacement of a server too old to reload."""
    lines = []
    installed = server.get("installed_version")
    if installed:
        lines.append(f"installed version {installed}")
    if server.get("can_reload") is False:
        protocol = ".".join(str(n) for n in server.get("protocol_version") or []) or "?"
        lines.append(f"cannot re-execute in place (protocol {protocol})"
                     + ("; replaced once it runs no instance" if server.get("replacement") == "when_idle" else ""))
    count = server.get("reexec_count")
    if count:
        lines.append(f"re-executed in place {count} time{'s' if count != 1 else ''}, last at"
                     f" {server.get('last_reexec_at') or '-'}")
    last = server.get("last_reload") or {}
    if last.get("outcome") == "refused":
        lines.append(f"last reload (attempt {last.get('attempt')}) refused at {last.get('at') or '-'}:"
                     f" {last.get('reason')}")
    replaced = server.get("last_replaced") or {}
    if replaced:
        lines.append(f"replaced the old server (pid {replaced.get('old_pid')}) by pid {replaced.get('new_pid')}"
                     f" at {replaced.get('at') or '-'}")
    return lines


def _link_lines(link: dict[str, Any]) -> list[str]:
    """What the backend's link to a control server has seen: losses, restarts, giving up."""
    lines = []
    restarts, losses = int(link.get("restarts") or 0), int(link.get("losses_in_window") or 0)
    loop = link.get("crash_loop") or {}
    if restarts or losses:
        line = f"restarted {restarts} time{'s' if restarts != 1 else ''} after a loss"
        if loop.get("window_s") is not None:
            line += (f"; {losses} loss{'es' if losses != 1 else ''} in the last {loop['window_s']} s"
                     + (f" (gives up at {loop['limit']})" if loop.get("limit") else ""))
        lines.append(line)
    replaced = int(link.get("replacements") or 0)
    if replaced:
        lines.append(f"replaced {replaced} time{'s' if replaced != 1 else ''} by a newer version")
    gave_up = link.get("gave_up") or {}
    last = link.get("last_loss") or {}
    if gave_up:
        lines.append(f"gave up at {gave_up.get('at') or '-'}: {gave_up.get('reason')} (`kandev up` tries again)")
    elif last:
        lines.append(f"last lost at {last.get('at') or '-'}: {last.get('reason')}")
    return lines


def _passthrough_lines(link: dict[str, Any]) -> list[str]:
    """The backend's own passthrough control server: one line, then its losses if any."""
    if not link:
        return []
    state = str(link.get("state") or "unknown")
    head = f"passthrough server: {state}" + (f", pid {link['pid']}" if link.get("pid") else "")
    return [head] + [f"  {line}" for line in _link_lines(link)]


def _block(term: Term, label: str, lines: list[str]) -> list[str]:
    lines = [line for line in lines if line]
    if not lines:
        return []
    head = term.bold(f"{label}:".rjust(LABEL))
    pad = " " * (LABEL + 1)
    return [f"{head} {lines[0]}"] + [f"{pad}{line}" for line in lines[1:]]


def _backend_lines(backend: dict[str, Any]) -> list[str]:
    lines = []
    if backend.get("home"):
        lines.append(f"home {backend['home']}")
    if backend.get("socket"):
        lines.append(f"socket {backend['socket']}")
    if "config" in backend:
        lines.append(f"config {backend['config'] or '- (no file: defaults)'}")
    return lines + _extras(backend, _KNOWN["backend"])


def _capability_lines(term: Term, cap: dict[str, Any]) -> list[str]:
    state = str(cap.get("state") or "unknown")
    paint = {"enabled": term.green, "unavailable": term.red}.get(state, term.yellow)
    head = paint(state) + (f" ({cap['reason']})" if cap.get("reason") else "")
    if cap.get("supervisor"):
        head += f", supervisor {cap['supervisor']}"
    lines = [head]
    if cap.get("detail"):
        lines.append(str(cap["detail"]))
    if "auto_resume" in cap:
        lines.append("Automatic resume is " + ("on: a session a restart interrupted gets its agent back by itself"
                     if cap["auto_resume"] else "off (features.auto_resume = false): kandev resume SESSION")
                     + ".")
    return lines + _extras(cap, _KNOWN["capability"])


def _server_lines(term: Term, server: dict[str, Any]) -> list[str]:
    state = str(server.get("state") or "unknown")
    paint = term.green if state == LinkState.RUNNING else (
        term.dim if state == LinkState.NONE else term.yellow if state in _HEALTHY_SERVER else term.red)
    head = paint(state)
    if server.get("mode"):
        head += f", {server['mode']} mode"
    if server.get("pid"):
        head += f", pid {server['pid']}"
    if server.get("version"):
        head += f", version {server['version']}"
    lines = [head]
    for key, label in (("server_identity", "identity"), ("endpoint", "endpoint"), ("log_path", "log")):
        if server.get(key):
            lines.append(f"{label} {server[key]}")
    return (lines + _version_lines(server) + _link_lines(server)
            + _passthrough_lines(server.get("passthrough") or {}) + _extras(server, _KNOWN["control_server"]))


def _recovery_lines(term: Term, recovery: dict[str, Any]) -> list[str]:
    missed = int(recovery.get("not_retracked") or 0)
    head = (f"{recovery.get('retracked', 0)} re-tracked, "
            + (term.yellow(f"{missed} not re-tracked") if missed else "0 not re-tracked")
            + f", {recovery.get('stopped_orphans', 0)} orphans stopped"
            + f", took {duration_ms(recovery.get('duration_ms'))}")
    lines = [head]
    clean = int(recovery.get("stopped_with_backend") or 0)
    if clean:
        left = int(recovery.get("stopped_without_agent", clean) or 0)  # a backend too old to say: all of them
        then = (f"{left} still without one: `kandev resume SESSION` gives one an agent again" if left
                else "each has an agent again")
        lines.append(f"{clean} session{'s' if clean != 1 else ''} had {'their agents' if clean != 1 else 'its agent'}"
                     f" stopped with the previous backend (kandev down): nothing to re-track; {then}")
    reasons = recovery.get("reasons") or {}
    if isinstance(reasons, dict):
        for sid, reason in sorted(reasons.items()):
            lines.append(f"session {short(str(sid))} not re-tracked: {reason}")
    return lines + _extras(recovery, _KNOWN["recovery"])


_NETWORK_KEYS = {"network_mode", "network_namespace", "network"}


def _network_lines(term: Term, sandbox: dict[str, Any]) -> list[str]:
    """Agents' network (Issue 44): the configured mode, whether each agent gets a network namespace
    of its own here, and what the egress proxies refused (how many, the last few destinations)."""
    own = sandbox.get("network_namespace")
    where = ("every agent in a network namespace of its own, out only through its egress proxy" if own
             else term.yellow("agents cannot get a network namespace of their own: no agent starts") if own is False
             else "whether agents get a network namespace of their own: not known yet")
    lines = [f"mode {sandbox.get('network_mode')}; {where}"]
    refused = network_refusals(sandbox.get("network"))
    if refused is not None:
        lines.append(term.yellow(refused) if (sandbox.get("network") or {}).get("refused") else refused)
    return lines


def _cluster_lines(cluster: dict[str, Any]) -> list[str]:
    """This host's name, then the hosts by state (Issue 47)."""
    lines = [f"host {cluster.get('host')} (a heartbeat every {cluster.get('heartbeat_s')} s; a host silent"
             f" {cluster.get('host_timeout_s')} s is unreachable)"]
    if cluster.get("error"):
        return [*lines, str(cluster["error"])]
    ready, stopped = cluster.get("ready") or [], cluster.get("stopped") or []
    unreachable = cluster.get("unreachable") or []
    lines.append(f"hosts: {len(ready)} ready" + (f" ({', '.join(ready)})" if ready else "")
                 + f", {len(unreachable)} unreachable"
                 + (f" ({', '.join(str(h.get('name')) for h in unreachable)})" if unreachable else "")
                 + (f", {len(stopped)} stopped ({', '.join(stopped)})" if stopped else ""))
    return lines


def _adoption_lines(adoption: dict[str, Any]) -> list[str]:
    head = str(adoption.get("outcome") or "unknown")
    if adoption.get("reason"):
        head += f" ({adoption['reason']})"
    return [head] + _extras(adoption, _KNOWN["adoption"])


def render_status(status: dict[str, Any], term: Term) -> list[str]:
    backend = status.get("backend") or {}
    state = str(backend.get("state") or "unknown")
    found = warnings(status)
    ready = state == BackendState.READY
    dot_paint = term.green if ready and not found else (term.yellow if ready else term.red)
    head = (f"{dot_paint(term.bullet)} {term.bold('kandev-backend')}: {dot_paint(state)}"
            f" (pid {backend.get('pid', '-')}, version {backend.get('version', '-')})")
    lines = [head]
    for warning in found:
        lines.append(term.yellow(f"{'Warning:'.rjust(LABEL)} {warning}"))
    lines += _block(term, "Backend", _backend_lines(backend))
    lines += _block(term, "Survival", _capability_lines(term, status.get("capability") or {}))
    lines += _block(term, "Control server", _server_lines(term, status.get("control_server") or {}))
    lines += _block(term, "Adoption", _adoption_lines(status.get("adoption") or {}))
    lines += _block(term, "Recovery", _recovery_lines(term, status.get("recovery") or {}))
    sandbox = status.get("sandbox")
    if isinstance(sandbox, dict) and "network_mode" in sandbox:
        lines += _block(term, "Network", _network_lines(term, sandbox))
    cluster = status.get("cluster")
    if isinstance(cluster, dict):
        lines += _block(term, "Cluster", _cluster_lines(cluster))
    for key, value in status.items():
        if key in _ORDER or key == "cluster":
            continue
        if key == "sandbox" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in _NETWORK_KEYS}
        if key == "store" and isinstance(value, dict):  # an unreachable server: said in the warning
            value = {k: v for k, v in value.items() if k not in ("unreachable_since", "unreachable")}
        label = str(key).replace("_", " ").capitalize()
        if isinstance(value, dict):
            lines += _block(term, label, _extras(value, set()) or ["-"])
        elif value is not None:
            lines += _block(term, label, [_value(value)])
    return lines
