"""A real npm agent driven end to end through kandev against its provider's stand-in (Issue 22).

``running(name, standin, cache, env=..., files=...)`` starts one backend (survival on) for a test
module: the agent ``name`` configured only through kandev's TOML, ``[agents.NAME]`` with its
``env``, its key in a 0600 file named by ``secret_env`` and its configuration files in
``home_files`` (written 0600 under the module's directory by ``write_file``). The helpers drive
turns and check what the scenarios check: the key is in no file under the kandev home (the
agent's HOME and every log included), no ``session show``, no argv.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.support.kandev import Kandev, make_env
from tests.support.messages_standin import StandIn

TURN_TIMEOUT = 120
START_TIMEOUT = 180


@dataclass
class AgentEnv:
    name: str
    k: Kandev
    standin: StandIn
    dir: Path
    key: str
    key_var: str

    def write_file(self, name: str, text: str) -> Path:
        """A configuration file (0600, ours) to name in ``home_files``; rewritten in place."""
        path = self.dir / "files" / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        return path

    def session_home(self, sid: str) -> Path:
        return self.k.home / "sessions" / sid / "agent" / "home"


def source_name(dest: str) -> str:
    """The name of the host file ``running`` writes for the HOME file ``dest``."""
    return dest.replace("/", "_")


def _toml_table(values: Mapping[str, str]) -> str:
    return "{ " + ", ".join(f'"{k}" = "{v}"' for k, v in values.items()) + " }"


@contextlib.contextmanager
def running(name: str, standin: StandIn, cache: Path, *, key_var: str,
            env: Callable[[StandIn], Mapping[str, str]],
            files: Callable[[StandIn], Mapping[str, str]]) -> Iterator[AgentEnv]:
    """One backend for a module, with ``standin`` started: ``env(standin)`` is the agent's plain
    ``env``, ``files(standin)`` its ``home_files`` as {destination in HOME: file text}."""
    key = f"sk-{name}-test-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d, standin:
        os.chmod(d, 0o700)
        root = Path(d)
        (root / "secrets").mkdir(mode=0o700)
        key_file = root / "secrets" / f"{name}-api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (key + "\n").encode())
        os.close(fd)
        e = AgentEnv(name, Kandev(root / "home", {}), standin, root, key, key_var)
        sources = {dest: str(e.write_file(source_name(dest), text)) for dest, text in files(standin).items()}
        config = root / "kandev.toml"
        config.write_text(
            "[features]\nagent_survival = true\n\n"
            + standin.network_table() +
            f"[agents.{name}]\n"
            f"env = {_toml_table(env(standin))}\n"
            f"secret_env = {_toml_table({key_var: str(key_file)})}\n"
            f"home_files = {_toml_table(sources)}\n"
        )
        e.k.env = make_env(config, npm_config_cache=str(cache))
        try:
            e.k.up()
            yield e
        finally:
            e.k.cleanup()


def start(e: AgentEnv, title: str) -> str:
    task = e.k.cli("task", "create", "--title", title)["task_id"]
    sid: str = e.k.cli("session", "start", task, "--agent", e.name, timeout=START_TIMEOUT)["session_id"]
    e.k.show(sid)
    return sid


def turn(e: AgentEnv, sid: str, text: str) -> dict[str, Any]:
    result = e.k.cli("prompt", sid, text, "--wait", timeout=TURN_TIMEOUT)
    assert result["stop_reason"] == "end_turn", result
    return e.k.show(sid)


def user_texts(show: dict[str, Any]) -> list[str]:
    """Every user message of the transcript: the prompts and any user chunk an agent sent."""
    return [m["text"] for m in show["transcript"] if m["role"] == "user"]


def agent_process(agent_pid: int, needle: str) -> psutil.Process:
    """The agent's own process inside the sandbox whose bwrap is ``agent_pid``."""
    procs = [p for p in psutil.Process(agent_pid).children(recursive=True)
             if p.name() != "bwrap" and needle in " ".join(p.cmdline())]
    assert procs, f"no {needle} process under {agent_pid}"
    return procs[0]


def not_root(pid: int) -> bool:
    """``pid`` is not root: not host uid 0 (an agent of kandev running as root runs as its own
    user) or, where it is, not uid 0 inside the user namespace its sandbox made either."""
    found = re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found is not None
    outside = int(found.group(1))
    if outside != 0:
        return True
    for line in Path(f"/proc/{pid}/uid_map").read_text().splitlines():
        inside, first, count = map(int, line.split())
        if first <= outside < first + count:
            return inside + outside - first != 0
    return True  # host root is not mapped into its namespace at all


def files_holding(root: Path, needle: bytes) -> list[str]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            try:
                if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                    found.append(str(p))
            except OSError:
                continue
    return found


def argv_holding(needle: str) -> list[int]:
    hits = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle.encode() in (p / "cmdline").read_bytes():
                    hits.append(int(p.name))
            except OSError:
                continue
    return hits


def assert_key_nowhere(e: AgentEnv, sid: str) -> None:
    """Issue 22 scenario A's last check: the key is in no file under the kandev home (the session's HOME,
    every agent and daemon log), no ``session show`` (JSON or human), no argv; ``kandev agents``
    and ``kandev doctor`` name the files, never a key."""
    k = e.k
    found = files_holding(k.home, e.key.encode())
    assert not found, f"the key is in {found}"
    assert e.key not in k.run("session", "show", sid).stdout + k.human("session", "show", sid).stdout
    pids = argv_holding(e.key)
    assert not pids, f"the key is in the argv of {pids}"
    assert e.key not in k.run("agents").stdout + k.run("doctor").stdout
