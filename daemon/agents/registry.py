"""Registry of the agents kandev knows how to start (``kandev agents``).

Each entry names its package and pinned version and builds the argv that
starts the agent speaking ACP over stdio.

The npm agents are *managed npm runtimes* (NPM-CTX-1, NPM-CTX-2): their
package name, exact version, ACP arguments and command shape are trusted
built-in metadata, never taken from a caller. They start as
``npx --yes --prefer-offline <package>@<version> <acp args...>`` (a direct argv,
no shell); ``kandev runtime update AGENT`` (``daemon.runtimes``) prepares and
repairs exactly that ``<package>@<version>``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.core.version import VERSION


@dataclass(frozen=True)
class BuiltinAgent:
    name: str
    package: str
    version: str
    argv_factory: Callable[[], list[str]]
    runtime: str = "python"  # "python" (runs from kandev's own code) or "npm" (a managed npm runtime)
    acp_args: tuple[str, ...] = ()
    # Variables every launch of this agent gets unless ``[agents.NAME] env`` overrides them
    # (``daemon.agents.settings``): e.g. keeping Claude Code off every host but its model API.
    default_env: tuple[tuple[str, str], ...] = ()
    # The hosts this agent's provider needs (``daemon.agents.network``): its egress proxy admits them
    # in the allow-list mode, before ``[network] allow_hosts`` and ``[agents.NAME] allow_hosts``.
    allow_hosts: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command line that starts this agent."""
        return self.argv_factory()

    @property
    def npm_spec(self) -> str:
        """The exact ``<package>@<version>`` of a managed npm runtime."""
        if self.runtime != "npm":
            raise ValueError(f"agent {self.name!r} is not a managed npm runtime")
        return f"{self.package}@{self.version}"


# The mock runs from the code of the server that spawns it, named explicitly: the agent's
# environment carries no PYTHONPATH, and an editable install's import hook may point elsewhere
# (at a tree the sandbox does not show the agent).
_RUN_FROM_CODE_ROOT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def code_root() -> str:
    """The directory holding this process's ``daemon`` package (kandev's own code)."""
    import daemon

    return str(Path(daemon.__file__).resolve().parent.parent)


def _mock_argv() -> list[str]:
    return [sys.executable, "-c", _RUN_FROM_CODE_ROOT, code_root(), "daemon.agents.mock"]


# npm package names (optionally scoped) and exact release versions: no tags, ranges,
# prereleases, URLs, paths or shell text (NPM-CTX-1, NPM-CTX-2).
NPM_PACKAGE_RE = re.compile(r"^(?:@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*$")
EXACT_VERSION_RE = re.compile(r"^(?:0|[1-9][0-9]*)\.(?:0|[1-9][0-9]*)\.(?:0|[1-9][0-9]*)$")


def npx_argv(package: str, version: str, acp_args: tuple[str, ...] = ()) -> list[str]:
    """How a managed npm agent starts: the exact spec through npx, preferring the local cache."""
    return ["npx", "--yes", "--prefer-offline", f"{package}@{version}", *acp_args]


def npm_agent(name: str, package: str, version: str, acp_args: tuple[str, ...] = (),
              default_env: tuple[tuple[str, str], ...] = (), allow_hosts: tuple[str, ...] = ()) -> BuiltinAgent:
    if not NPM_PACKAGE_RE.match(package) or ".." in package:
        raise ValueError(f"agent {name!r}: {package!r} is not a plain npm package name")
    if not EXACT_VERSION_RE.match(version):
        raise ValueError(f"agent {name!r}: {version!r} is not an exact release version")
    return BuiltinAgent(
        name=name,
        package=package,
        version=version,
        argv_factory=lambda: npx_argv(package, version, acp_args),
        runtime="npm",
        acp_args=tuple(acp_args),
        default_env=default_env,
        allow_hosts=allow_hosts,
    )


BUILTIN_AGENTS: dict[str, BuiltinAgent] = {
    agent.name: agent
    for agent in (
        BuiltinAgent(name="mock", package="daemon.agents.mock", version=VERSION, argv_factory=_mock_argv),
        # Pinned to releases checked on the npm registry (npm view <pkg> versions).
        # No telemetry, error reporting or update checks: the agent talks to its model API only.
        npm_agent("claude-code", "@zed-industries/claude-code-acp", "0.16.2",
                  default_env=(("DISABLE_TELEMETRY", "1"), ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")),
                  allow_hosts=("api.anthropic.com",)),
        # codex-acp runs ``codex app-server``, which (unlike Codex's own terminal UI) checks for no
        # update; its provider, analytics and update switches live in $CODEX_HOME/config.toml
        # (``[agents.codex] home_files``).
        npm_agent("codex", "@agentclientprotocol/codex-acp", "2.6.0", allow_hosts=("api.openai.com",)),
        # ``--acp`` (``--experimental-acp`` is its deprecated alias). Trusting the workspace kandev
        # gave it (else Gemini ignores the workspace's settings and asks), no telemetry.
        npm_agent("gemini", "@google/gemini-cli", "0.61.0", ("--acp",),
                  default_env=(("GEMINI_CLI_TRUST_WORKSPACE", "true"), ("GEMINI_TELEMETRY_ENABLED", "false")),
                  allow_hosts=("generativelanguage.googleapis.com",)),
        # No models list from models.dev, no self-update, no session sharing, no language-server
        # downloads: OpenCode talks to its configured provider only. npm offline: at every start
        # OpenCode installs its plugin package into its config directory in the background (the
        # session's HOME is new, so every session: ~15 s of CPU and the npm registry); offline,
        # npm gives up at once and nothing is installed (a session uses no plugin kandev did not give it).
        npm_agent("opencode", "opencode-ai", "1.18.33", ("acp",),
                  default_env=(("OPENCODE_DISABLE_MODELS_FETCH", "1"), ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
                               ("OPENCODE_DISABLE_SHARE", "1"), ("OPENCODE_DISABLE_LSP_DOWNLOAD", "1"),
                               ("npm_config_offline", "true")),
                  # its provider is configured (opencode.json); Anthropic's is the one kandev documents
                  allow_hosts=("api.anthropic.com",)),
    )
}


def get_agent(name: str) -> BuiltinAgent:
    """The built-in agent called ``name``; KeyError naming the known agents otherwise."""
    try:
        return BUILTIN_AGENTS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_AGENTS))
        raise KeyError(f"unknown agent {name!r}; built-in agents: {known}") from None
