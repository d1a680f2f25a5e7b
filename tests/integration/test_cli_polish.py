"""The small things a user notices at once (Issue 46 Why 6), each through the real CLI; each test
fails on the behaviour before the fix (Issue 46 scenario A).

- help: every command group's help lists exactly the commands it takes (``task`` listed ``finish``,
  which does not exist), in the stored ``--help`` too;
- ``kandev agents`` is a table with a header (``--json`` as before);
- ``prompt --wait`` names the turn by 8 characters, as every other view does;
- a second answer to a permission request says it was already answered, with what and when;
- a stopped session reads the same on the board as in ``session list`` (``NO AGENT``);
- ``session list`` at 80 columns keeps the task id and the state whole and shows some title;
- the runtime's first preparation says what is wrong, then what happens now (no instruction);
- ``man kandev`` finds the page after the dev set-up, with the venv on the PATH;
- the demo leaves no home behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev, make_env
from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

ESCAPES = re.compile(r"\x1b\[[0-9;]*m")


def _kandev(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60, cwd=REPO_ROOT)


def _commands_listed(help_text: str) -> dict[str, str]:
    """The commands a help lists under ``COMMAND``, each with its one-line help (joined)."""
    listed: dict[str, str] = {}
    name = None
    for line in help_text.split("  COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines():
        m = re.match(r"^    (\S+)(?:\s+(.*))?$", line)
        if m:
            name = m[1]
            listed[name] = m[2] or ""
        elif name is not None:
            listed[name] = (listed[name] + " " + line.strip()).strip()
    return listed


def test_every_group_help_lists_exactly_its_commands() -> None:
    """Issue 46 Why 6 (Issue 46 item 6): ``kandev GROUP --help`` says which commands the group takes, and they
    are the ones it takes (``task`` said ``finish``; ``done`` exists); the top-level help (stored, at 80
    columns, and laid out by argparse at others) says the same."""
    top = _kandev("--help", env={**os.environ, "COLUMNS": "80"}).stdout
    wide = _kandev("--help", env={**os.environ, "COLUMNS": "200"}).stdout
    helps = {name: _kandev(name, "--help", env={**os.environ, "COLUMNS": "200"}).stdout
             for name in _commands_listed(wide)}
    groups = {name: _commands_listed(wide)[name] for name, text in helps.items() if "  COMMAND\n" in text}
    assert {"task", "session", "agentctl", "store", "runtime"} <= set(groups), groups
    assert "finish" not in top and "finish" not in wide
    for group, line in groups.items():
        said = [w.strip() for w in line.split(":")[-1].split(",")]
        own = helps[group]
        assert said == list(_commands_listed(own)), (group, said, own)
        assert f": {', '.join(said)}" in own.split("\n\n")[1].replace("\n", " ")  # its own description
        for command in said:
            assert _kandev(group, command, "--help").returncode == 0, (group, command)
    assert " ".join(_commands_listed(top)["task"].split()) == groups["task"]
    refused = _kandev("task", "finish", "abcd")
    assert refused.returncode == 2 and "unknown command 'finish'" in refused.stderr


def test_agents_is_a_table_with_a_header(kandev_factory: Any) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): ``kandev agents`` prints a table with a header (it printed tab-
    separated rows without one); ``--json`` keeps its form."""
    k = kandev_factory()
    p = k.human("agents")
    assert p.returncode == 0 and "\t" not in p.stdout, p.stdout
    lines = p.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("AGENT "))
    assert lines[header].split() == ["AGENT", "PACKAGE", "VERSION", "SECRET_ENV", "HOME_FILES", "ENV", "NETWORK"]
    listed = k.cli("agents")["agents"]
    assert [line.split()[0] for line in lines[header + 1:header + 1 + len(listed)]] == [a["name"] for a in listed]
    assert set(listed[0]) >= {"name", "package", "version", "runtime", "env", "secret_env", "home_files"}
    # bash completion reads the agents' names from the table
    completion = REPO_ROOT / "packaging" / "bash-completion" / "kandev"
    names = subprocess.run(["bash", "-c", f"source {completion}; _kandev_agents"], capture_output=True, text=True,
                           env={**k.env, "PATH": f"{Path(sys.executable).parent}:{k.env['PATH']}"}, timeout=60)
    assert names.stdout.split() == [a["name"] for a in listed], names.stdout + names.stderr


@pytest.fixture(scope="module")
def backend() -> Iterator[Kandev]:
    """One backend (survival off) for the session tests below."""
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d:
        os.chmod(d, 0o700)
        config = Path(d) / "kandev.toml"
        config.write_text("")
        kandev = Kandev(Path(d) / "home", make_env(config))
        try:
            kandev.up()
            yield kandev
        finally:
            kandev.cleanup()


def test_prompt_wait_names_the_turn_by_8_characters(backend: Kandev) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): ``prompt --wait`` printed the turn's 32-hex id; 8 characters, as
    elsewhere."""
    _task, sid = backend.start_session("short turn id")
    p = backend.human("prompt", sid[:8], "hello", "--wait")
    assert p.returncode == 0, p.stderr
    turn = backend.show(sid)["turns"][-1]["turn_id"]
    assert p.stdout.startswith(f"Turn {turn[:8]}: ") and turn not in p.stdout, p.stdout
    sent = backend.human("prompt", sid[:8], "again")
    assert re.match(r"Prompt sent: turn [0-9a-f]{8}\n", sent.stdout), sent.stdout


def test_a_second_answer_says_the_request_was_already_answered(backend: Kandev) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): answering a permission request twice says "already answered (allow, N
    s ago)" rather than that no request is open; a request that never existed is still not found."""
    _task, sid = backend.start_session("permission twice")
    backend.cli("prompt", sid, "/permission")
    request = wait_until(lambda: next((p["request_id"] for p in backend.show(sid).get("permissions") or []
                                       if p["state"] == "open"), None), timeout=30)
    first = backend.human("permission", sid[:8], request[:8], "--option", "allow")
    assert first.returncode == 0, first.stderr
    again = backend.human("permission", sid[:8], request[:8], "--option", "allow")
    assert again.returncode == 1, again.stdout
    assert re.search(r"already answered \(allow, \d+ s ago\)", again.stderr), again.stderr
    assert "no open permission request" not in again.stderr
    refused = backend.run("permission", sid, request, "--cancel")
    assert json.loads(refused.stdout)["error"]["details"]["answer"] == "allow"
    unknown = backend.human("permission", sid[:8], "f" * 32, "--option", "allow")
    assert unknown.returncode == 1 and "already" not in unknown.stderr


def _pty_run(k: Kandev, *args: str, columns: int) -> str:
    """The CLI with stdout on a pseudo-terminal of ``columns`` columns: what it wrote, no colour."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {key: v for key, v in k.env.items() if key not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--home", str(k.home), *args],
                            stdout=slave, stderr=subprocess.PIPE, env={**env, "TERM": "xterm"}, cwd=REPO_ROOT)
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, "no output on the pty within 30 s"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=30)
    return ESCAPES.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


def test_a_stopped_session_reads_the_same_on_the_board_and_in_the_list(backend: Kandev) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): after ``session stop`` the board said WAITING_FOR_INPUT while
    ``session list`` said ``(no agent)``; both now say NO AGENT, and ``kandev resume`` brings both back."""
    title = "stopped and listed"
    task, sid = backend.start_session(title)
    backend.cli("session", "stop", sid)

    def row(text: str) -> str:
        return next(line for line in text.splitlines() if sid[:8] in line and task[:8] in line)

    board, listed = row(backend.human("board").stdout), row(backend.human("session", "list").stdout)
    assert "NO AGENT" in board and "NO AGENT" in listed, (board, listed)
    assert "WAITING_FOR_INPUT" not in board + listed
    backend.cli("resume", sid)
    board, listed = row(backend.human("board").stdout), row(backend.human("session", "list").stdout)
    assert "WAITING_FOR_INPUT" in board and "WAITING_FOR_INPUT" in listed, (board, listed)


def test_session_list_at_80_columns_keeps_ids_and_state_whole(backend: Kandev) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): at 80 columns ``session list`` cut the task id and dropped the title
    while a long STATE stayed whole; now the ids and the state are whole, some of the title is shown, and no
    line is wider than the terminal."""
    title = "a title long enough to be cut at eighty columns, surely"
    task, sid = backend.start_session(title)
    backend.cli("session", "stop", sid)
    out = _pty_run(backend, "session", "list", columns=80)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["SESSION", "TASK", "TITLE", "AGENT", "STATE"], out
    row = next(line for line in lines if line.startswith(sid[:8]))
    assert row.split()[1] == task[:8] and title[:8] in row and "NO AGENT" in row, row
    assert max(len(line) for line in lines) <= 80, out


def test_first_preparation_says_what_is_wrong_then_what_happens(short_tmp: Path, kandev_factory: Any) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): a session of an agent whose runtime is not prepared said "(... run
    kandev runtime update claude-code to prepare it); preparing it first": an instruction mixed with an
    action. Now: what is wrong, then what kandev does now. (npm is offline with an empty cache here: the
    preparation fails fast, which is beside the point.)"""
    cache = short_tmp / "npm"
    cache.mkdir()
    k = kandev_factory(npm_config_cache=str(cache), npm_config_offline="true")
    k.up()
    task = k.cli("task", "create", "--title", "first use")["task_id"]
    p = k.human("session", "start", task, "--agent", "claude-code", timeout=240)
    lines = p.stderr.splitlines()
    assert lines[0].startswith("kandev: the runtime of claude-code is not prepared yet: "), p.stderr
    assert "to prepare it" not in lines[0] and "runtime update" not in lines[0], lines[0]
    assert lines[1] == ("kandev: preparing it now (as `kandev runtime update claude-code` does), then starting"
                        " the session:"), p.stderr


def test_man_kandev_works_after_the_dev_setup() -> None:
    """Issue 46 Why 6 (Issue 46 item 6): after ``packaging/dev/setup.sh`` with the venv on the PATH (as the
    README's quick start says), ``man kandev`` finds kandev(1) (it found nothing)."""
    done = subprocess.run(["bash", str(REPO_ROOT / "packaging" / "dev" / "setup.sh")], capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    venv = Path(done.stdout.strip().splitlines()[-1])
    env = {k: v for k, v in os.environ.items() if k not in ("MANPATH", "MANPAGER", "PAGER")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    for page, section in (("kandev", "1"), ("kandev-backend", "8"), ("kandev-agentctl", "8")):
        found = subprocess.run(["man", "-w", page], capture_output=True, text=True, env=env, timeout=30)
        assert found.returncode == 0, found.stderr
        path = Path(found.stdout.strip())
        assert path == venv / "share" / "man" / f"man{section}" / f"{page}.{section}", path
        assert path.read_text() == (REPO_ROOT / "packaging" / "man" / f"{page}.{section}").read_text()
    text = subprocess.run(["man", "kandev"], capture_output=True, text=True, env={**env, "MANPAGER": "cat"},
                          timeout=30)
    assert text.returncode == 0 and "kandev" in text.stdout


def test_the_demo_leaves_no_home_behind(short_tmp: Path) -> None:
    """Issue 46 Why 6 (Issue 46 item 6): the demo left its home under /var/tmp; it now stops what it started
    and removes the home it made."""
    config = short_tmp / "empty.toml"
    config.write_text("")
    done = subprocess.run([sys.executable, "-m", "daemon.cli.demo"], capture_output=True, text=True,
                          env=make_env(config), timeout=280, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"\[demo\] home (\S+);", done.stdout)
    assert m, done.stdout
    assert not Path(m[1]).exists(), done.stdout
    assert "is removed" in done.stdout.splitlines()[-1]
