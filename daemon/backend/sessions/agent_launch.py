"""What every agent launch of the backend carries besides the agent's command line.

- The session's private directories (``daemon.host.session_dirs``), created 0700 before the launch.
- The environment: ``HOME``, the session's own ``agent/home`` (kept across restarts: an agent's
  own storage, e.g. Claude Code's ``~/.claude``, is there for ``session/load``), the agent's state
  directory (the mock agent's ``KANDEV_MOCK_STATE_DIR``), the agent's built-in defaults and its
  ``[agents.NAME] env`` (``daemon.agents.settings``) and, for a GitHub-backed workspace, the git
  credential routing to the session's own credential endpoint
  (``daemon.backend.git.credential_endpoints``), opened here.
- The agent's own files (``[agents.NAME] home_files``), copied into its HOME before every launch
  (``daemon.agents.home_files``): start, resume and a restart alike.
- The agent's secrets by reference (``[agents.NAME] secret_env``: paths or ``credential:NAME``),
  which the control server reads itself at spawn: no secret value passes through the backend.
- The agent's network (``network_request``): its mode, hosts and host_ports from ``[network]`` and
  ``[agents.NAME]`` (``daemon.config.settings.agent_network``), for its egress proxy.
- The sandbox request (``daemon.agentctl.sandbox.bubblewrap.SandboxRequest``): the policy from
  ``agents.sandbox``; read-write the agent's state and lease directories (the workspace is added
  by the control server from the cwd); read-only the endpoint's directory; hidden the kandev home,
  ``/etc/kandev``, the configured token file, the configuration file and every agent's secret
  files, wherever they lie. For a git worktree, what the sandbox shows of its repository comes
  from the task's record (``daemon.backend.git.workspace_record.launch_view``: the workspace is
  checked against the record first, and nothing is read from the workspace's ``.git``).

``agent_command`` is the agent's command line: the built-in one, or for a managed npm runtime in a
sandbox its prepared entry (``daemon.runtimes.launch``). ``prepare`` is for a launch that gets a
new lease (start, resume: the session is already durably STARTING); ``prepare_relaunch`` for one
that keeps its lease (a context reset that restarts the agent changes nothing else: the same
command, environment and sandbox).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daemon.agentctl.sandbox.bubblewrap import SANDBOX_UNAVAILABLE, SandboxPolicy, SandboxRequest
from daemon.agents import home_files, memory
from daemon.agents.mock.state import STATE_DIR_ENV
from daemon.agents.registry import BuiltinAgent
from daemon.agents.settings import AGENT_PATH, agent_env, secret_paths
from daemon.backend.git import workspace_record
from daemon.backend.git.workspace_record import RepositoryView
from daemon.config.settings import DEFAULT_CONFIG_FILE, Config, agent_network
from daemon.credentials import GitCredentials
from daemon.credentials.agent_env import agent_git_env
from daemon.credentials.broker import POLICY_GITHUB_LEASE
from daemon.host.agent_user import give_file
from daemon.host.paths import Paths
from daemon.host.session_dirs import SessionDirs
from daemon.runtimes.launch import RUNTIME_NOT_PREPARED, RuntimeNotPrepared, find_prepared
from daemon.store.models import Task, TaskSession
from ipc.errors import ErrorCode, IpcError

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext as Backend

__all__ = ["RUNTIME_NOT_PREPARED", "SANDBOX_UNAVAILABLE", "AgentCommand", "LaunchPrep", "agent_command", "prepare",
           "hidden_paths", "prepare_relaunch", "sandbox_request", "sandbox_status"]

STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AgentCommand:
    """What starts the agent: its argv, what its sandbox must show read-only for it, and what goes
    first on its PATH."""

    argv: list[str]
    readonly: tuple[str, ...] = ()
    path_first: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # built-in defaults + [agents.NAME] env
    secret_env: dict[str, str] = field(default_factory=dict)  # {VAR: path | credential:NAME}
    agent: str = ""
    home_files: dict[str, str] = field(default_factory=dict)  # {path in HOME: host file}


@dataclass(frozen=True)
class LaunchPrep:
    command: list[str]
    env: dict[str, str]
    sandbox: dict[str, Any]  # the wire form of the SandboxRequest
    credentials: GitCredentials | None = None
    secret_env: dict[str, str] = field(default_factory=dict)  # references, for create_instance
    network: dict[str, Any] | None = None  # the agent's NetworkPolicy on the wire (None: sandbox off)


def network_request(config: Config, agent: str) -> dict[str, Any] | None:
    """The agent's network policy for ``create_instance`` (``daemon.config.settings.agent_network``);
    None for an unsandboxed agent, which has the host's network."""
    if config.agents.sandbox == SandboxPolicy.OFF.value:
        return None
    return agent_network(config, agent).to_wire()


async def agent_command(backend: Backend, agent: BuiltinAgent) -> AgentCommand:
    """The built-in argv; for a managed npm runtime in a sandbox its prepared entry instead
    (``daemon.runtimes.launch``): ``runtime_not_prepared`` when ``kandev runtime update`` never
    prepared it."""
    configured = backend.config.agents.settings
    env = agent_env(agent.name, configured)
    secrets = configured[agent.name].secret_refs() if agent.name in configured else {}
    files = dict(configured[agent.name].home_files) if agent.name in configured else {}
    if agent.runtime != "npm" or backend.config.agents.sandbox == SandboxPolicy.OFF.value:
        return AgentCommand(list(agent.argv()), env=env, secret_env=secrets, agent=agent.name, home_files=files)
    try:
        prepared = await asyncio.to_thread(find_prepared, agent)
    except RuntimeNotPrepared as exc:
        raise IpcError(RUNTIME_NOT_PREPARED, str(exc)) from None
    return AgentCommand(prepared.command, (str(prepared.tree),), str(prepared.bin_dir), env, secrets, agent.name, files)


def hidden_paths(config: Config, paths: Paths) -> list[str]:
    """What no sandbox of kandev's shows, wherever it lies."""
    hidden = [str(paths.home), str(DEFAULT_CONFIG_FILE.parent)]  # kandev's own config directory, /etc/kandev
    if config.credentials.github_token_file:
        hidden.append(config.credentials.github_token_file)
    if config.source:
        hidden.append(config.source)
    hidden += secret_paths(config.agents.settings)  # every agent's keys: each gets its own in its environment
    return hidden


def sandbox_request(config: Config, paths: Paths, dirs: SessionDirs, readonly: tuple[str, ...] = (),
                    repository: RepositoryView | None = None) -> SandboxRequest:
    repo = repository or RepositoryView()
    return SandboxRequest(
        policy=SandboxPolicy(config.agents.sandbox),
        writable=(str(dirs.agent_state), str(dirs.git), *repo.writable),
        readonly=(str(dirs.endpoint), *readonly, *repo.readonly),
        hidden=(*hidden_paths(config, paths), *repo.hidden),
        max_processes=config.agents.max_processes,
    )


def _launch_view(backend: Backend, session_id: str) -> RepositoryView:
    """The session's workspace checked against its task's record, and its repository's binds
    (blocking: the store and the file system)."""
    with backend.store.session() as db:
        session = db.get(TaskSession, session_id)
        task = db.get(Task, session.task_id) if session is not None else None
        if task is None or not task.workspace:
            return RepositoryView()
        rec = workspace_record.load(db, task.id)
        workspace = task.workspace
    return workspace_record.launch_view(rec, workspace)


def _base_env(dirs: SessionDirs, command: AgentCommand) -> dict[str, str]:
    env = {**command.env, "HOME": str(dirs.home), STATE_DIR_ENV: str(dirs.mock_state)}
    if command.path_first:
        env["PATH"] = os.pathsep.join([command.path_first, command.env.get("PATH", AGENT_PATH)])
    return env


async def _dirs(backend: Backend, session_id: str, command: AgentCommand) -> SessionDirs:
    """The session's directories, with the agent's configured files copied into its HOME."""
    dirs = await asyncio.to_thread(SessionDirs.for_session(backend.paths.home, session_id).ensure)
    try:
        await asyncio.to_thread(home_files.install, dirs.home, command.agent, command.home_files)
    except home_files.HomeFileError as exc:
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"cannot launch the agent: {exc}", retryable=False) from None
    return dirs


async def prepare(backend: Backend, session_id: str, command: AgentCommand) -> LaunchPrep:
    """Directories, a new git lease (policy ``none`` without a GitHub origin or token) with its
    endpoint, the environment and the sandbox request. The session must be durably STARTING."""
    view = await asyncio.to_thread(_launch_view, backend, session_id)  # refused before any lease
    dirs = await _dirs(backend, session_id, command)
    env = _base_env(dirs, command)
    creds = await asyncio.to_thread(backend.git_credentials, session_id, env, dirs.endpoint_socket)
    # the lease file (or the no-lease one) is the agent's: its git reads it and writes a reissued one back
    if await asyncio.to_thread(os.path.lexists, dirs.lease_file):
        await asyncio.to_thread(give_file, dirs.lease_file)
    if creds.policy == POLICY_GITHUB_LEASE:
        await backend.endpoints.open(session_id)
    env.update(creds.env)
    request = sandbox_request(backend.config, backend.paths, dirs, command.readonly, view)
    return LaunchPrep(command.argv, env, request.to_wire(), creds, dict(command.secret_env),
                      network_request(backend.config, command.agent))


async def prepare_relaunch(backend: Backend, session_id: str, agent: BuiltinAgent, *, with_lease: bool) -> LaunchPrep:
    """The same command, environment and sandbox as the session's running agent had, with its
    current lease file and no new lease (``with_lease``: the session's policy is a GitHub lease, so
    its endpoints are served; a lease file without a lease, written when no token is configured,
    keeps the agent's git routed to kandev's transport, which says so)."""
    command = await agent_command(backend, agent)
    dirs = await _dirs(backend, session_id, command)
    env = _base_env(dirs, command)
    if await asyncio.to_thread(dirs.lease_file.exists):
        if with_lease:
            await backend.endpoints.open(session_id)
        env.update(agent_git_env(dirs.lease_file, dirs.endpoint_socket, base_env=env,
                                 github_url=backend.config.credentials.github_url))
    view = await asyncio.to_thread(_launch_view, backend, session_id)
    request = sandbox_request(backend.config, backend.paths, dirs, command.readonly, view)
    return LaunchPrep(command.argv, env, request.to_wire(), secret_env=dict(command.secret_env),
                      network=network_request(backend.config, command.agent))


def memory_status(config: Config, reported: Any) -> dict[str, Any]:
    """``kandev status``'s ``memory``: the bound (``agents.max_memory``, per agent where set) and whether
    agents started now get a memory cgroup with it, where, and why not, as the control server in use
    reports it (``reported``: ``sandbox_status``'s ``memory``; None when it did not say)."""
    agents = config.agents
    out: dict[str, Any] = {
        "bounded": False, "hierarchy": None, "cgroup": None,
        "reason": "the control server did not say (none runs yet, or it predates per-agent memory bounds)",
        "max_memory": memory.default_bound() if agents.max_memory is None else agents.max_memory,
        "per_agent": {name: s.max_memory for name, s in sorted(agents.settings.items()) if s.max_memory is not None},
    }
    if isinstance(reported, dict):
        out.update(bounded=bool(reported.get("bounded")), hierarchy=reported.get("hierarchy"),
                   cgroup=reported.get("cgroup"), reason=reported.get("reason"))
    return out


async def sandbox_status(backend: Backend) -> dict[str, Any]:
    """``kandev status``'s ``sandbox``: the policy, and whether agents started now are sandboxed
    (as the control server in use reports it) and why not."""
    policy = backend.config.agents.sandbox
    out: dict[str, Any] = {"policy": policy, "sandboxed": False, "available": None, "reason": None,
                           "mechanism": "bubblewrap", "version": None, "seccomp": None,
                           "network_mode": backend.config.network.mode, "network_namespace": None, "network": None}
    client = backend.client
    if client is not None and client.usable:
        try:
            support = await client.call("sandbox_status", {}, timeout=STATUS_TIMEOUT_S)
            out.update(available=bool(support.get("available")), reason=support.get("reason"),
                       version=support.get("version"), seccomp=support.get("seccomp"),
                       memory=support.get("memory"), network_namespace=support.get("network_namespace"),
                       network=support.get("network"))
        except IpcError as exc:
            if exc.code == ErrorCode.UNKNOWN_OP:
                out["available"] = False  # it cannot: a launch there is refused (AgentctlClient.check_sandbox)
            out["reason"] = ("the control server predates the agent sandbox (the backend replaces it with the"
                             " installed version once it runs no instance)"
                             if exc.code == ErrorCode.UNKNOWN_OP else f"the control server did not say: {exc.message}")
        except (OSError, TimeoutError) as exc:
            out["reason"] = f"the control server did not say: {exc}"
    else:
        out["reason"] = "no control server yet"
    if policy == SandboxPolicy.OFF.value:
        out["reason"] = 'agents.sandbox = "off": agents run unsandboxed'
    else:
        out["sandboxed"] = out["available"] is True
        if out["available"] is False:
            out["reason"] = f"{out['reason']}; agent starts fail with {SANDBOX_UNAVAILABLE} (agents.sandbox = \"required\")"
    return out
