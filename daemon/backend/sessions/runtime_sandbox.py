"""Runtime preparation's sandbox: npm and the ACP probe of a runtime job reach npm's registry and
nothing else (Issue 44 item 3).

``kandev runtime update AGENT`` and an agent's first use run one runtime job
(``daemon.runtimes.update``): ``npm config get cache``, ``npm exec --prefer-online --package=<spec>``
(which downloads the package and runs its install scripts) and the ACP probe of the result. Each of
those commands runs here the way an agent runs, in a sandbox of its own (bubblewrap,
``daemon.agentctl.sandbox.bubblewrap.wrap_command``):

- its own network namespace (only its own loopback), whose one way out is an egress proxy of the
  same kind as an agent's (``daemon.agentctl.egress.listener.SessionEgress`` behind the relay,
  ``HTTPS_PROXY`` and npm's own ``proxy``/``https-proxy`` naming it). The proxy belongs to the
  backend and lives as long as the job (a job does not outlive its backend: the next one marks it
  interrupted). Its allow-list is exactly the host:port of the registry npm is configured with
  (and the agent package scope's registry, when one is set), read once per job
  (``daemon.runtimes.registry``); a registry on a private address is reachable at exactly that
  address and port, every other private destination is refused. A refusal is the 403 agents get,
  a ``network_refused`` journal entry naming the runtime preparation (``JOB_ID``,
  ``PURPOSE=runtime_preparation``) and one more line of the job's events (``kandev runtime update``
  prints it);
- the agents' system-call filter, no capability, its own pid and IPC namespaces;
- a view of the system read-only (as an agent's: ``/usr``, ``/etc`` without its root-only files,
  the node and Python prefixes), npm's cache and the runtime work directory (``<home>/runtimes``,
  with ``HOME`` in it) read-write, npm's user and global configuration files read-only; nothing else
  of the kandev home, no secret kandev hides from agents.

It runs as the backend's own uid (the cache and the prepared trees are the backend's, as before:
agents run them read-only, and a tree an agent's uid owned could be rewritten for every other
agent), mapped 1:1 in its user namespace: root when the backend runs as root, without any
capability. Its environment is npm's settings from the backend's (``npm_config_*``), the locale,
the CA variables and the proxy; nothing else of the backend's environment.

With ``agents.sandbox = "off"`` jobs run npm as before (the host's network, the backend's
environment), as agents then run unsandboxed; a host that cannot make the sandbox fails the job
saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from daemon.agentctl.egress.listener import SOCKET_NAME, SessionEgress
from daemon.agentctl.sandbox import bubblewrap as sandbox
from daemon.agentctl.sandbox import network
from daemon.agentctl.sandbox import probe as sandbox_probe
from daemon.agentctl.sandbox.bubblewrap import SandboxPolicy, SandboxRequest
from daemon.agents.registry import BUILTIN_AGENTS
from daemon.backend.sessions.agent_launch import hidden_paths
from daemon.config.settings import Config
from daemon.core.journal import log_event
from daemon.host.agent_user import AgentUser
from daemon.host.paths import Paths
from daemon.runtimes import registry
from daemon.runtimes.proc import Confine, Confined, ConfineError
from daemon.runtimes.update import Job
from ipc.aio import within
from ipc.errors import IpcError

log = logging.getLogger("kandev.backend.runtimes")

EGRESS_DIR = "runtime-egress"
PURPOSE = "runtime_preparation"
RESOLVE_TIMEOUT_S = 20.0
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "SSL_CERT_DIR")
CA_ENV = ("NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "SSL_CERT_DIR")
# npm settings kandev sets itself inside: where npm goes and which files it reads
_OWN_NPM = re.compile(r"(?i)^npm_config_(registry|proxy|https_proxy|http_proxy|noproxy|no_proxy|cache|userconfig"
                      r"|globalconfig)$")


def backend_user() -> AgentUser:
    """Who runs inside: the backend's own uid and gid, mapped to themselves."""
    return AgentUser(os.geteuid(), os.getegid(), "kandev backend", False)


def sandbox_env(env: Mapping[str, str], settings: registry.NpmSettings, home: Path) -> dict[str, str]:
    """The environment of a command in the preparation sandbox (see the module docstring)."""
    out = {k: v for k, v in env.items() if k in KEPT_ENV or k.startswith("LC_")
           or (k.lower().startswith("npm_config_") and not _OWN_NPM.match(k))}
    out.setdefault("PATH", os.defpath)
    out["HOME"] = str(home)
    out["npm_config_cache"] = str(settings.cache)
    out["npm_config_registry"] = settings.registry
    if settings.userconfig:
        out["npm_config_userconfig"] = settings.userconfig
    if settings.globalconfig:
        out["npm_config_globalconfig"] = settings.globalconfig
    out["npm_config_proxy"] = out["npm_config_https_proxy"] = network.PROXY_URL
    out["npm_config_noproxy"] = ""
    return network.proxy_env(out, True)


async def resolve_private(endpoints: Sequence[registry.Endpoint]) -> dict[str, list[registry.Address]]:
    """Each registry name's addresses (a name that does not resolve: none; the proxy reports it)."""
    loop = asyncio.get_running_loop()
    out: dict[str, list[registry.Address]] = {}
    for end in endpoints:
        try:
            infos = await within(loop.getaddrinfo(end.host, end.port), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError):
            continue
        out[end.host] = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    return out


class RuntimeSandbox:
    """The confinement of the backend's runtime jobs (``RuntimeJobs(confinement=...)``)."""

    def __init__(self, config: Callable[[], Config], paths: Paths, workdir: Path) -> None:
        self.config = config
        self.paths = paths
        self.workdir = workdir
        self.egress_root = Path(paths.run_dir) / EGRESS_DIR

    @contextlib.asynccontextmanager
    async def confinement(self, job: Job, env: Mapping[str, str],
                          note: Callable[[str], None]) -> AsyncIterator[Confine | None]:
        config = self.config()
        if config.agents.sandbox == SandboxPolicy.OFF.value:
            log_event("runtime_unsandboxed", f"runtime job {job.job_id} ({job.agent}): npm runs WITHOUT a sandbox"
                      " (agents.sandbox = \"off\"): it can reach every network this backend can",
                      priority=4, JOB_ID=job.job_id, AGENT=job.agent)
            yield None
            return
        support = await asyncio.to_thread(sandbox_probe.probe, env)  # a trial sandbox, as for agents
        if not support.available or support.bwrap is None or not support.network_namespace:
            raise ConfineError(f"the sandbox cannot be made here: {support.reason}; agents.sandbox = \"required\""
                               " runs npm only in one (install bubblewrap and allow user and network namespaces,"
                               " or set agents.sandbox = \"off\" to run agents, and npm, unsandboxed)")
        bwrap = support.bwrap
        package = BUILTIN_AGENTS[job.agent].package if job.agent in BUILTIN_AGENTS else job.package
        try:
            settings = await asyncio.to_thread(registry.read, package, env, self.workdir)
            endpoints = [registry.endpoint(url) for url in settings.registries]
            policy = registry.policy(endpoints, await resolve_private(endpoints), job.agent)
            await asyncio.to_thread(os.makedirs, settings.cache, 0o755, True)
        except (registry.RegistryError, OSError) as exc:
            raise ConfineError(str(exc)) from None
        home = self.workdir / "home"
        await asyncio.to_thread(os.makedirs, home, 0o700, True)
        path = str(self.egress_root / job.job_id[:16] / SOCKET_NAME)
        egress = SessionEgress(job.job_id, "", job.agent, policy, path,
                               subject=f"runtime preparation of {job.agent} (runtime job {job.job_id})",
                               fields={"JOB_ID": job.job_id, "PURPOSE": PURPOSE})
        try:
            await asyncio.to_thread(egress.bind, None, None)
        except OSError as exc:
            raise ConfineError(f"cannot open the preparation's proxy socket {path}: {exc}") from None
        egress.note = lambda line: note(line.removeprefix("kandev: "))  # the CLI prints "kandev: " itself
        egress.start()
        shown = ", ".join(e.render() for e in endpoints)
        note(f"sandboxed: npm reaches only {shown} (npm's registry) through kandev's proxy")
        try:
            yield self._confine(config, settings, path, home, bwrap)
        finally:
            await egress.close()

    def _confine(self, config: Config, settings: registry.NpmSettings, socket_path: str, home: Path,
                 bwrap: str) -> Confine:
        """Each command of the job in a sandbox of its own, behind the job's proxy at ``socket_path``."""
        readonly = [os.path.dirname(socket_path)]
        for file in (settings.userconfig, settings.globalconfig):
            if file and os.path.isabs(file):
                readonly.append(file)
        request = SandboxRequest(
            policy=SandboxPolicy.REQUIRED,
            writable=(str(settings.cache), str(home)),
            readonly=tuple(readonly),
            hidden=tuple(hidden_paths(config, self.paths)),
            max_processes=config.agents.max_processes,
        )
        net = network.SandboxNet(socket_path)

        async def confine(argv: Sequence[str], env: Mapping[str, str]) -> Confined:
            inner = sandbox_env(env, settings, home)
            cas = [inner[k] for k in CA_ENV if os.path.isabs(inner.get(k, ""))]
            req = SandboxRequest(request.policy, request.writable, (*request.readonly, *cas), request.hidden,
                                 request.max_processes) if cas else request
            try:
                launch = await asyncio.to_thread(sandbox.wrap_command, req, list(argv), str(self.workdir),
                                                 bwrap=bwrap, env=inner, net=net, user=backend_user())
            except IpcError as exc:
                raise ConfineError(exc.message) from None
            except (ValueError, OSError) as exc:
                raise ConfineError(f"the preparation's sandbox cannot be made: {exc}") from None
            return Confined(tuple(launch.argv), inner, launch.fds)

        return confine

    def prune(self) -> None:
        """Remove the proxy directories jobs of a previous backend left (blocking; at start)."""
        shutil.rmtree(self.egress_root, ignore_errors=True)
