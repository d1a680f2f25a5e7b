"""Issue 14: the CLI for people, through the real CLI against real daemons.

A: without --json no command prints a JSON object or list on a line of its own; board shows
   titles; session list is a table with a header; session show reads as a conversation.
B: every id-taking command accepts an 8-character prefix; an ambiguous 4-character prefix exits 1
   with ambiguous_id and the candidates (ids made to collide honestly: real tasks are created
   until two real ids share their first 4 characters).
C: ``kandev prompt SID "/slow 8" --follow`` prints the chunks as they come; exit 0.
D: survival on: ``kandev follow`` across a backend SIGKILL and across ``kandev down``/``up``
   prints every chunk exactly once, in order, says it reconnected, exits 0; a backend that stays
   away ends it with exit status 3.
E: into a pipe or with NO_COLOR no escape sequence; colour and the terminal's width on a pty.
Plus: bash completion offers live ids from the backend, and nothing when it is down.

Tests A, B, C, E and the completion share one backend (module scope) to keep the suite lean.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.api import ops as api
from ipc.client import SyncClient
from tests.support.kandev import Kandev, make_env
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import TimedOutput
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
COMPLETION = REPO_ROOT / "packaging" / "bash-completion" / "kandev"
ESC = "\x1b"


@pytest.fixture(scope="module")
def k() -> Iterator[Kandev]:
    """One backend (survival off) with a task and a session that has had two turns."""
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


@pytest.fixture(scope="module")
def session(k: Kandev) -> dict[str, str]:
    task = k.cli("task", "create", "--title", "Fix the login bug")["task_id"]
    sid = k.cli("session", "start", task, "--prompt", "hello there")["session_id"]
    wait_until(lambda: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=30)
    k.cli("prompt", sid, "second turn", "--wait")
    return {"task": task, "sid": sid}


def _json_lines(text: str) -> list[str]:
    """Lines that are a JSON object or list on their own."""
    found = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("{", "[")):
            try:
                json.loads(s)
            except ValueError:
                continue
            found.append(line)
    return found


def _waiting(k: Kandev, sid: str) -> dict[str, Any]:
    return wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)


def test_scenario_a_every_command_reads_as_text_with_8_char_ids(k: Kandev, session: dict[str, str]) -> None:
    """Issue 14 scenario A, and Issue 14 scenario B's first half: every id-taking command is given an
    8-character prefix (task show/workflow/proceed, session start/show/configure/reset-context,
    prompt, permission (session and request), cancel, resume, follow)."""
    t8, s8 = session["task"][:8], session["sid"][:8]
    runs: list[tuple[tuple[str, ...], subprocess.CompletedProcess[str]]] = []

    def h(*args: str, code: int | None = 0) -> subprocess.CompletedProcess[str]:
        p = k.human(*args)
        runs.append((args, p))
        if code is not None:
            assert p.returncode == code, (args, p.returncode, p.stdout, p.stderr)
        return p

    h("up")
    status = h("status").stdout
    assert "kandev-backend: ready" in status and "Control server:" in status
    h("task", "create", "--title", "Plan the release", "--steps", "plan,review")
    planned = next(t for t in k.cli("task", "list")["tasks"] if t["title"] == "Plan the release")["task_id"]
    tasks = h("task", "list").stdout
    assert tasks.splitlines()[0].split()[:3] == ["TASK", "TITLE", "BUCKET"] and "Fix the login bug" in tasks
    assert "Fix the login bug" in h("task", "show", t8).stdout
    assert "plan" in h("task", "workflow", planned[:8]).stdout
    assert "entered step 'review'" in h("task", "proceed", planned[:8]).stdout

    assert "Prompt sent" in h("prompt", s8, "/permission").stdout
    request = wait_until(lambda: [p for p in k.show(session["sid"])["permissions"] if p["state"] == "open"],
                         timeout=30)[0]["request_id"]
    h("permission", s8, request[:8], "--option", "allow")
    _waiting(k, session["sid"])
    h("session", "configure", s8, "--mode", "plan")
    h("session", "reset-context", s8)
    h("prompt", s8, "/slow 30")
    wait_until(lambda: "1/30 " in json.dumps(k.show(session["sid"])["transcript"]), timeout=30)
    h("cancel", s8)
    _waiting(k, session["sid"])
    h("prompt", s8, "/exit 3")
    wait_until(lambda: k.show(session["sid"])["state"] == "FAILED", timeout=30)
    h("resume", s8)
    _waiting(k, session["sid"])
    second = h("session", "start", t8).stdout  # a second session of the task, then its list
    assert "Started session" in second

    listed = h("session", "list").stdout.splitlines()
    assert listed[0].split() == ["SESSION", "TASK", "TITLE", "AGENT", "STATE", "AGE", "LAST", "TURN"]
    assert any(line.startswith(s8) and "Fix the login bug" in line for line in listed[1:])
    h("session", "list", "--all")
    board = h("board").stdout
    assert "Fix the login bug" in board and "Plan the release" in board and "TURN FINISHED" in board
    show = h("session", "show", s8).stdout
    for expected in ("> hello there", "echo: hello there", "> second turn", "echo: second turn",
                     "[turn ended: end_turn]", "[turn cancelled]", "permission: allow"):
        assert expected in show, expected
    assert show.index("> hello there") < show.index("echo: hello there") < show.index("> second turn")
    assert len(h("session", "show", s8, "--tail", "3").stdout) < len(show)
    # follow replays the session's last turn (over: the agent exited) and exits 1 for it
    assert h("follow", s8, code=1).stdout.splitlines()[-1] == "[turn failed: agent_exited]"
    h("agents")
    h("doctor", code=None)  # may fail a check on this host; its output is what matters here

    for args, p in runs:
        assert not _json_lines(p.stdout) and not _json_lines(p.stderr), (args, p.stdout)
    # --json callers get prefixes resolved too, and exactly the old shapes
    shown = k.cli("session", "show", s8)
    assert shown["session_id"] == session["sid"]
    assert set(k.cli("session", "list")["sessions"][0]) == {"session_id", "task_id", "state", "retracked"}
    assert set(k.cli("board")) == {"backlog", "running", "turn_finished", "needs_attention", "done"}
    events = [json.loads(line) for line in k.run("follow", s8).stdout.splitlines()]
    assert events and {e["kind"] for e in events} <= {"entry", "turn_ended"} and all("seq" in e for e in events)


def test_scenario_b_an_ambiguous_prefix_is_refused_with_the_candidates(k: Kandev, session: dict[str, str]) -> None:
    """Issue 14 scenario B: tasks are created (real ids from the backend) until two share their
    first 4 characters; that prefix is refused with ambiguous_id, naming both, and changes nothing."""
    seen: dict[str, str] = {}
    pair: tuple[str, str] | None = None
    with SyncClient(str(k.home / "run" / "backend.sock"), protocol_major=api.VERSION[0]) as client:
        for _ in range(3000):  # ~320 expected for 65536 prefixes; 3000 without a pair: p < 1e-29
            tid = client.call("task_create", {"title": "collide"}, timeout=30)["task_id"]
            if tid[:4] in seen:
                pair = (seen[tid[:4]], tid)
                break
            seen[tid[:4]] = tid
    assert pair is not None
    prefix = pair[0][:4]
    sessions_before = len(k.cli("session", "list")["sessions"])
    human = k.human("task", "show", prefix)
    assert human.returncode == 1
    assert f"task id '{prefix}' is ambiguous" in human.stderr
    assert pair[0] in human.stderr and pair[1] in human.stderr and "hint:" in human.stderr
    as_json = k.run("task", "show", prefix)
    error = json.loads(as_json.stdout)["error"]
    assert as_json.returncode == 1 and error["code"] == "ambiguous_id"
    assert set(pair) <= set(error["details"]["candidates"])
    refused = k.run("session", "start", prefix)
    assert refused.returncode == 1 and json.loads(refused.stdout)["error"]["code"] == "ambiguous_id"
    assert len(k.cli("session", "list")["sessions"]) == sessions_before  # nothing started
    assert k.cli("task", "show", pair[1][:8])["task_id"] == pair[1]
    short = k.run("task", "show", "abc")  # under 4 characters: only a whole id matches
    assert short.returncode == 1 and json.loads(short.stdout)["error"]["code"] == "not_found"


def test_scenario_c_prompt_follow_prints_chunks_as_they_come(k: Kandev, session: dict[str, str]) -> None:
    """Issue 14 scenario C: the first chunk within 2 s of the prompt, the others one by one as the
    agent writes them (one a second), the last at the turn's end; exit 0. A failed turn: exit 1."""
    s8 = session["sid"][:8]
    _waiting(k, session["sid"])
    proc = k.popen("prompt", s8, "/slow 8", "--follow")
    out, err = TimedOutput(proc.stdout), TimedOutput(proc.stderr)
    prompted = out.wait_for("> /slow 8", timeout=60)
    assert proc.wait(timeout=90) == 0, err.text
    arrivals = [out.arrival(f"{i}/8 ") for i in range(1, 9)]
    assert all(a is not None for a in arrivals), out.text
    assert arrivals[0] - prompted < 2.0
    assert arrivals == sorted(arrivals) and arrivals[-1] - arrivals[0] >= 4.0  # streamed, not batched at the end
    assert out.arrival("[turn ended: end_turn]") >= arrivals[-1]
    assert re.findall(r"\d+/8 ", out.text) == [f"{i}/8 " for i in range(1, 9)]
    failed = k.human("prompt", s8, "/fail", "--follow")
    assert failed.returncode == 1 and "[turn" in failed.stdout, (failed.stdout, failed.stderr)


def _pty_run(k: Kandev, *args: str, columns: int = 200, **env: str) -> str:
    """Run the CLI with stdout on a pseudo-terminal of ``columns`` columns; what it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    # COLUMNS (pytest-xdist workers export it) would override the terminal's own size, as it should
    base = {key: v for key, v in k.env.items() if key not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--home", str(k.home), *args],
                            stdout=slave, stderr=subprocess.PIPE, env={**base, "TERM": "xterm", **env}, cwd=REPO_ROOT)
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, "no output on the pty within 30 s"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    return b"".join(chunks).decode(errors="replace")


def test_scenario_e_colour_only_on_a_terminal_without_no_color(k: Kandev, session: dict[str, str]) -> None:
    """Issue 14 scenario E: into a pipe, or with NO_COLOR=1, no escape sequence anywhere; on a
    terminal colour, and lines cut to the terminal's width."""
    s8 = session["sid"][:8]
    commands = [("status",), ("board",), ("task", "list"), ("session", "list"), ("session", "show", s8),
                ("follow", s8), ("session", "show", "nope")]
    for args in commands:  # a pipe alone (TERM says colour would work) is enough
        p = k.human(*args, TERM="xterm-256color")
        assert ESC not in p.stdout and ESC not in p.stderr, args
    coloured = _pty_run(k, "status")
    assert f"{ESC}[" in coloured and "kandev-backend" in coloured
    assert ESC not in _pty_run(k, "status", NO_COLOR="1")
    k.cli("task", "create", "--title", "a title much longer than a narrow terminal could ever show on one line")
    narrow = _pty_run(k, "task", "list", columns=60, NO_COLOR="1")
    assert all(len(line) <= 60 for line in narrow.splitlines()), narrow
    assert "\u2026" in narrow


def test_board_watch_redraws_when_the_board_changes(k: Kandev, session: dict[str, str]) -> None:
    """Issue 14 item 1: `board --watch` prints the board again when it changed, until Ctrl-C."""
    proc = k.popen("board", "--watch", "--interval", "0.2")
    out = TimedOutput(proc.stdout)
    out.wait_for("Fix the login bug", timeout=30)
    k.cli("task", "create", "--title", "Watch me appear")
    out.wait_for("Watch me appear", timeout=30)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    out.join()
    assert out.text.count("BACKLOG (") == 2  # drawn once, then once more for the one change


def _complete(k: Kandev, bindir: Path, *words: str) -> list[str]:
    script = (f"source {COMPLETION}\nCOMP_WORDS=(kandev {' '.join(words)})\nCOMP_CWORD={len(words)}\n_kandev\n"
              'printf "%s\\n" "${COMPREPLY[@]}"')
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True, timeout=30,
                       env={**k.env, "PATH": f"{bindir}:{os.environ['PATH']}"}, check=True)
    assert p.stderr == ""
    return p.stdout.split()


def test_bash_completion_offers_live_ids_and_nothing_when_the_backend_is_down(
        k: Kandev, session: dict[str, str], tmp_path: Path) -> None:
    """Issue 14 item 4: `kandev` on PATH is the real CLI for this home (as packaging/bin/kandev is)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "kandev"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m daemon.cli --home {k.home} "$@"\n')
    wrapper.chmod(0o755)
    assert session["sid"][:8] in _complete(k, bindir, "session", "show", "")
    assert session["sid"][:8] in _complete(k, bindir, "follow", "")
    assert session["task"][:8] in _complete(k, bindir, "task", "show", "")
    assert "--reconnect-timeout" in _complete(k, bindir, "follow", "--")
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m daemon.cli --home {tmp_path / "nobody"} "$@"\n')
    # no backend: no ids, no error in the shell (stderr is checked empty), just the options
    assert _complete(k, bindir, "session", "show", "") == ["--tail", "--after-seq", "--limit", "--help", "--json",
                                                          "--home"]  # the global flags go after the command too


def test_scenario_d_follow_survives_backend_restarts(kandev_factory) -> None:
    """Issue 14 scenario D (survival on): a follow started before the backend is SIGKILLed and
    started again (and later stopped with `kandev down` and started with `kandev up`, in the same
    turn) prints all 40 chunks exactly once, in order, says it reconnected, exits 0; a backend that
    stays away ends a follow with exit status 3 after the bounded wait."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    k.up()
    _, sid = k.start_session("follow me")
    k.cli("prompt", sid, "/slow 40")
    proc = k.popen("follow", sid[:8])
    out, err = TimedOutput(proc.stdout), TimedOutput(proc.stderr)
    out.wait_for("3/40 ", timeout=60)
    backend = k.backend_pid
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    k.up()
    wait_until(lambda: "reconnected to the backend" in err.text, timeout=60)
    out.wait_for("9/40 ", timeout=60)  # 31 chunks (>= 30 s of the agent's time) still to come
    k.cli("down")
    k.up()
    assert proc.wait(timeout=90) == 0, err.text
    assert re.findall(r"\d+/40 ", out.text) == [f"{i}/40 " for i in range(1, 41)]
    assert err.text.count("lost the connection to the backend") == 2
    assert err.text.count("reconnected to the backend") == 2
    assert out.text.rstrip().endswith("[turn ended: end_turn]")

    proc = k.popen("follow", sid[:8], "--all", "--reconnect-timeout", "2")  # --all: it stays
    out, err = TimedOutput(proc.stdout), TimedOutput(proc.stderr)
    out.wait_for("40/40 ", timeout=60)  # the last turn, replayed: the stream is open
    k.cli("down")
    started = time.monotonic()
    assert proc.wait(timeout=60) == 3
    err.join()
    assert "did not come back within 2 s" in err.text and time.monotonic() - started < 60


def test_what_an_agent_writes_reaches_a_terminal_without_its_control_characters(k: Kandev) -> None:
    """An agent's output is attacker input for the operator's terminal too: escape sequences in it
    (clear the screen, move up and rewrite a line, set the clipboard with OSC 52 for the next
    paste) are printed escaped by every view for people, live (``prompt --follow``) and after
    (``session show``, on a pty with colour too); ``--json`` keeps the agent's text as it was."""
    task = k.cli("task", "create", "--title", "escapes")["task_id"]
    sid = k.cli("session", "start", task)["session_id"]
    _waiting(k, sid)
    attack = r"A\033]52;c;ZWNobyBwd25lZA==\007B\033[2J\033[1A\rC\302\233D"  # \302\233: U+009B, a one-character CSI
    followed = k.human("prompt", sid, f"/sh printf '{attack}'", "--follow")
    assert followed.returncode == 0, followed.stderr
    shown = k.human("session", "show", sid)
    on_pty = _pty_run(k, "session", "show", sid)
    for out in (followed.stdout, shown.stdout):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]", out), repr(out)
        assert r"A\x1b]52;c;ZWNobyBwd25lZA==\x07B\x1b[2J\x1b[1A\x0dC\x9bD" in out, out
    assert r"A\x1b]52;c;ZWNobyBwd25lZA==\x07B\x1b[2J\x1b[1A\x0dC\x9bD" in on_pty, on_pty
    assert "\x1b]52" not in on_pty and "\x1b[2J" not in on_pty and "\x9b" not in on_pty  # kandev's own colours only
    said = [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"]
    assert any("A\x1b]52;c;ZWNobyBwd25lZA==\x07B\x1b[2J\x1b[1A\rC\x9bD" in t for t in said), said
