"""The import budget of the common ``kandev`` commands, as a list of modules, not a time
(Issue 24 item 3): the parser and the socket client for every command that talks to the backend;
the doctor, the configuration machinery, the agents' registry, asyncio and the views for people
only for the commands that use them. And the backend's own start: no ACP SDK (Issue 24's restart
with 1,000 agents in about a second).

Each command runs as a real process (``python -X importtime -m daemon.cli ...``) against a home
where no backend runs: it imports everything its path needs up to the connection (which is then
refused, exit 3), and ``-X importtime`` names every module it imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

# kandev's own modules the common commands may import, whatever the command.
BUDGET = {
    "daemon", "daemon.cli", "daemon.cli.quick", "daemon.cli.call", "daemon.cli.json_output", "daemon.cli.commands",
    "daemon.cli.backend_client", "daemon.cli.parser", "daemon.host.home", "daemon.core.version",
    "daemon.core", "daemon.host", "daemon.api", "daemon.api.ops", "daemon.api.version",
    "daemon.cli.human",
    "ipc", "ipc.errors", "ipc.schema", "ipc.framing", "ipc.hello", "ipc.sync_client", "ipc.codec_json",
}
# What printing for people adds (without --json): the views and their helpers, never the doctor.
HUMAN = {"daemon.cli.human.errors", "daemon.cli.human.fmt", "daemon.cli.human.render", "daemon.cli.human.status",
         "daemon.cli.human.table", "daemon.cli.human.term", "daemon.cli.human.transcript", "daemon.cli.human.views",
         "daemon.cli.human.visible", "daemon.store", "daemon.store.states"}  # the named states the views compare (enums only)
# Never for these commands: the heavy machinery of other commands and of the daemons.
NEVER = {"asyncio", "sqlalchemy", "acp", "tomllib", "subprocess", "daemon.backend", "daemon.cli.doctor", "daemon.config.settings",
         "daemon.config.keys", "daemon.config.agentctl",
         "daemon.config.platform", "daemon.agents", "daemon.agents.registry", "daemon.cli.human.follow", "ipc.client",
         "ipc.server", "ipc.aio", "uvloop", "psutil",
         # msgpack (a third of the interpreter's start, with datetime and collections): the CLI
         # speaks JSON to the backend (ipc.codec_json)
         "msgpack", "ipc.codec_msgpack",
         # stdlib modules that cost a CLI call much and that it does not need (dataclasses brings
         # inspect, ast and dis; secrets brings random, hashlib and hmac)
         "dataclasses", "inspect", "secrets", "random",
         # typing: kandev's modules on this path name types under TYPE_CHECKING only (~4 ms a call);
         # pathlib (~4 ms with urllib.parse and ipaddress): daemon.host.home spells the socket's path
         "typing", "pathlib", "daemon.host.paths"}


def imported(*argv: str, home: Path) -> set[str]:
    return _imports("-m", "daemon.cli", "--home", str(home), *argv)


def _imports(*python_args: str, exits_ok: bool = False) -> set[str]:
    """Every module ``python -X importtime *python_args`` imported, by name (``exits_ok``: and the
    process exited 0; a CLI call here exits 3, refused)."""
    p = subprocess.run([sys.executable, "-X", "importtime", *python_args],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "KANDEV_CONFIG": "/nonexistent"})
    modules = set()
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    assert modules, p.stderr
    assert p.returncode == 0 or not exits_ok, p.stderr
    return modules


def _own(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in ("daemon", "ipc")}


@pytest.mark.parametrize("argv", [
    ("--json", "status"), ("--help",), ("--json", "board"), ("--json", "task", "list"),
    ("--json", "session", "list"), ("--json", "session", "show", "abcd"), ("--json", "prompt", "abcd", "hi"),
])
def test_scripted_commands_import_only_the_parser_and_the_client(argv: tuple[str, ...], tmp_path: Path) -> None:
    modules = imported(*argv, home=tmp_path)
    assert _own(modules) <= BUDGET, sorted(_own(modules) - BUDGET)
    assert not modules & NEVER, sorted(modules & NEVER)


@pytest.mark.parametrize("argv", [("status",), ("board",), ("task", "list"), ("session", "list")])
def test_commands_for_people_add_only_the_views(argv: tuple[str, ...], tmp_path: Path) -> None:
    modules = imported(*argv, home=tmp_path)  # the refusal is printed for people: errors and its hint
    assert _own(modules) <= BUDGET | HUMAN, sorted(_own(modules) - BUDGET - HUMAN)
    assert not modules & NEVER, sorted(modules & NEVER)


def test_the_budget_check_sees_what_a_command_imports(tmp_path: Path) -> None:
    """The check can fail: ``doctor`` imports the doctor and the configuration."""
    modules = imported("--json", "doctor", home=tmp_path)
    assert {"daemon.cli.doctor", "daemon.config.settings"} <= modules


def test_the_views_for_people_import_nothing_heavy() -> None:
    """What a command for people adds once the backend answered (the two tests above stop at the
    refused connection): the views render with none of the modules a call must not pay for."""
    modules = _imports("-c", "import daemon.cli.human.render", exits_ok=True)
    assert "daemon.cli.human.views" in modules
    assert _own(modules) <= BUDGET | HUMAN, sorted(_own(modules) - BUDGET - HUMAN)
    assert not modules & (NEVER | {"shutil"}), sorted(modules & (NEVER | {"shutil"}))


# The quick path (daemon/cli/quick.py): kandev's modules it may import, and what it never does, not
# even from the standard library: the imports that made a call cost three interpreter starts.
QUICK_BUDGET = {"daemon", "daemon.cli", "daemon.cli.quick", "daemon.cli.call", "daemon.cli.json_output", "daemon.host",
                "daemon.host.home", "daemon.core", "daemon.api", "daemon.api.version", "daemon.cli.human", "daemon.core.version",
                "ipc", "ipc.errors", "ipc.schema", "ipc.framing", "ipc.hello", "ipc.sync_client",
                "ipc.codec_json"}
ENTRY = "import sys; from daemon.cli import main; sys.exit(main())"  # what packaging/scripts/kandev runs
QUICK_NEVER = NEVER | {"re", "enum", "argparse", "json", "socket", "gettext", "datetime", "daemon.cli.commands",
                       "daemon.cli.parser", "daemon.cli.backend_client", "daemon.api.ops"}


@pytest.mark.parametrize("argv", [
    ("--json", "status"), ("--help",), ("--version",), ("--json", "board"), ("--json", "task", "list"),
    ("task", "show", "abcd", "--json"),
    ("--json", "session", "list"), ("--json", "session", "show", "abcd"), ("--json", "prompt", "abcd", "hi"),
    ("--json", "logs", "abcd"),
])
def test_the_quick_path_imports_neither_the_grammar_nor_re_nor_enum(argv: tuple[str, ...], tmp_path: Path) -> None:
    """Issue 24 item 3: the calls the quick path serves, started as the ``kandev`` script starts them
    (its ``main``, not ``-m``), import no argparse, json, socket, re, enum or msgpack (~2.2 interpreter
    starts)."""
    home = () if argv in (("--help",), ("--version",)) else ("--home", str(tmp_path))
    modules = _imports("-c", ENTRY, *home, *argv)
    assert _own(modules) <= QUICK_BUDGET, sorted(_own(modules) - QUICK_BUDGET)
    assert not modules & QUICK_NEVER, sorted(modules & QUICK_NEVER)


def test_the_quick_path_check_sees_the_full_path(tmp_path: Path) -> None:
    """The check can fail: an option of the command (``--tail``) takes the full path, with argparse."""
    modules = _imports("-c", ENTRY, "--home", str(tmp_path), "--json", "session", "show", "abcd", "--tail", "5")
    assert {"argparse", "daemon.cli.commands", "re"} <= modules


def test_the_backend_starts_without_the_acp_sdk() -> None:
    """Issue 24 (restart in about a second): the backend never speaks ACP, and importing the SDK
    (some 270 pydantic models) cost its start about 0.4 s of a 0.9 s import. It came back once
    through the agent pipe's helpers, which the backend imported with the agent process's module
    for a constant; the pipe's asyncio helpers live apart from the SDK's now, and the backend
    imports neither the agent's process nor its pipe (the control server's side, ~11 ms more)."""
    modules = _imports("-c", "import daemon.backend.main, daemon.backend.app", exits_ok=True)
    assert {"daemon.backend.app", "daemon.backend.sessions.agent_launch", "sqlalchemy"} <= modules
    assert not {m for m in modules if m == "acp" or m.startswith("acp.")}, sorted(m for m in modules if m.startswith("acp"))
    assert not modules & {"daemon.agentctl.instance.process", "daemon.agentctl.instance.pipe"}


def test_the_backend_import_check_sees_the_sdk() -> None:
    """The check can fail: the control server's instance module imports the SDK."""
    modules = _imports("-c", "import daemon.agentctl.instance.instance", exits_ok=True)
    assert {"acp", "acp.schema"} <= modules
