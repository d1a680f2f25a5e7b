"""Each agent in a network namespace of its own, out only through its session's egress proxy (Issue 44 scenario A, Issue 44 scenario B, Issue 44 scenario C and Issue 44 scenario F): the real daemons, attacked from inside with the mock agent's ``/sh``.

The host services a test reaches for are its own, on loopback: a TCP listener, an abstract Unix
socket, a small HTTP server (the stand-in of a local model server or of a provider).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import secrets
import signal
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import CliError, Kandev
from tests.support.processes import alive
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(300)
CURL = "curl -sS -m 20"


def sh(k: Kandev, sid: str, script: str) -> str:
    """What the mock agent's ``/sh script`` printed (its exit status first)."""
    k.cli("prompt", sid, "/sh " + script, "--wait", timeout=180)
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


def start(k: Kandev, root: Path, name: str) -> str:
    ws = root / f"ws-{name}"
    ws.mkdir()
    task = k.cli("task", "create", "--title", name, "--workspace", str(for_agent(ws)))["task_id"]
    sid: str = k.cli("session", "start", task)["session_id"]
    k.show(sid)
    return sid


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.end_headers()
            for i in range(10_000):  # a line a few times a second until the client goes away
                try:
                    self.wfile.write(f"line {i}\n".encode())
                    self.wfile.flush()
                except OSError:
                    return
                self.server.streamed.set()  # type: ignore[attr-defined]
                time.sleep(0.2)
            return
        body = f"hello from {self.server.server_address[1]}\n".encode()  # type: ignore[index]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def http_servers() -> Iterator[list[_Server]]:
    """Two HTTP servers on the host's loopback (the test's own), stopped at teardown."""
    servers = []
    for _ in range(2):
        srv = _Server(("127.0.0.1", 0), _Quiet)
        srv.streamed = threading.Event()  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def port_of(srv: _Server) -> int:
    return int(srv.server_address[1])


def refused_events(k: Kandev) -> list[str]:
    log = k.home / "logs" / "agentctl.log"
    return [line for line in log.read_text(errors="replace").splitlines() if " network_refused " in line]


def test_issue_44_scenario_a_nothing_of_the_host_network_nor_of_another_agent_is_reachable(
        kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 44 scenario A: from inside a mock agent a TCP connect to a host loopback port the test
    listens on fails; a connect to a host abstract Unix socket the test binds fails; a second agent's
    abstract socket is unreachable from the first (while it answers inside its own sandbox);
    ``curl http://169.254.169.254/`` through the proxy gets 403; each refusal is a
    ``network_refused`` event and shows in ``session show``, ``kandev logs`` and ``kandev status``."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    abstract_name = f"kandev-test-{secrets.token_hex(4)}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + abstract_name)
    abstract.listen(8)
    try:
        k = kandev_factory()
        k.up()
        a, b = start(k, short_tmp, "a"), start(k, short_tmp, "b")
        b_name = f"kandev-b-{secrets.token_hex(4)}"
        listen_b = (f"import socket, time; s = socket.socket(socket.AF_UNIX); s.bind('\\\\0{b_name}'); s.listen(8);"
                    " open('/tmp/b-ready', 'w').close(); time.sleep(600)")
        said_b = sh(k, b, f"python3 -c \"{listen_b}\" >/dev/null 2>&1 & "
                          "for i in $(seq 200); do [ -e /tmp/b-ready ] && break; sleep 0.05; done; "
                          f"python3 -c \"import socket; socket.socket(socket.AF_UNIX).connect('\\\\0{b_name}');"
                          " print('B_SELF_OK')\"")
        assert "B_SELF_OK" in said_b, said_b  # the socket exists and answers in its own sandbox
        connect = ("import socket, sys\n"
                   "for name, family, addr in (('host_tcp', socket.AF_INET, ('127.0.0.1', int(sys.argv[1]))),"
                   " ('host_abstract', socket.AF_UNIX, '\\0' + sys.argv[2]), ('other_agent', socket.AF_UNIX,"
                   " '\\0' + sys.argv[3])):\n"
                   "    s = socket.socket(family); s.settimeout(5)\n"
                   "    try:\n"
                   "        s.connect(addr); print(name, 'REACHED')\n"
                   "    except OSError as e:\n"
                   "        print(name, 'refused', e.errno)\n")
        (short_tmp / "ws-a" / "connect.py").write_text(connect)
        said = sh(k, a, f"python3 connect.py {listener.getsockname()[1]} {abstract_name} {b_name}; "
                        f"{CURL} -o /dev/null -w 'status=%{{http_code}}\\n' http://169.254.169.254/latest/meta-data/")
        assert said.startswith("sh: exit=0\n"), said
        for name in ("host_tcp", "host_abstract", "other_agent"):
            assert f"{name} refused" in said, said
        assert "REACHED" not in said, said
        assert "status=403" in said, said
        show = k.show(a)
        assert show["network"]["refused"] == 1, show["network"]
        assert show["network"]["recent_refused"][-1]["host"] == "169.254.169.254", show["network"]
        events = wait_until(lambda: [e for e in refused_events(k) if "169.254.169.254" in e] or None, timeout=10)
        assert f"session_id={a}" in events[0] and "reason=private_address" in events[0] and "port=80" in events[0]
        assert "agent=mock" in events[0], events[0]
        human = k.human("session", "show", a).stdout
        assert "169.254.169.254:80" in human, human
        logs = wait_until(lambda: t if "kandev: refused 169.254.169.254:80" in (t := k.human("logs", a).stdout)
                          else None, timeout=10)
        assert "to allow it: [network] host_ports" in logs, logs  # kandev logs: among the agent's lines
        status = k.status()["sandbox"]
        assert status["network_mode"] == "allow-list" and status["network_namespace"] is True, status
        assert status["network"]["refused"] == 1 and status["network"]["recent_refused"][-1]["session_id"] == a
        human = k.human("status").stdout
        assert "mode allow-list; every agent in a network namespace of its own" in human, human
        assert "1 request refused, last: 169.254.169.254:80 (private_address)" in human, human
        checks = {c["name"]: c for c in json.loads(k.run("doctor").stdout)["checks"]}
        assert checks["network"]["ok"] and "network.mode = 'allow-list'" in checks["network"]["detail"], checks
    finally:
        listener.close()
        abstract.close()


def test_issue_44_scenario_b_host_ports_allow_exactly_what_they_list(
        kandev_factory: Any, short_tmp: Path, http_servers: list[_Server]) -> None:
    """Issue 44 scenario B: a loopback HTTP server listed in ``[network] host_ports`` is reachable
    through the proxy with the agent's own environment (plain ``curl``, no flag), one not listed is
    refused (403 naming the key that would allow it); an allow-listed name that resolves to
    127.0.0.1 (the proxy's test resolver: ``*.test`` is 127.0.0.1) is refused while its address is
    not in ``host_ports`` and reached once it is. A loopback destination not listed is the agent's
    own loopback: a server the agent runs there answers it through the proxy, the host's never."""
    listed, unlisted = (port_of(s) for s in http_servers)
    k = kandev_factory(config_text=f'[network]\nhost_ports = ["127.0.0.1:{listed}"]\n'
                                   f'allow_hosts = ["model.test:{listed}", "other.test:{unlisted}"]\n',
                       KANDEV_FAULT="egress_test_resolver")
    k.up()
    sid = start(k, short_tmp, "b")
    said = sh(k, sid, f"env | grep -i _proxy | sort; {CURL} http://127.0.0.1:{listed}/; "
                      f"{CURL} http://127.0.0.1:{unlisted}/; {CURL} http://model.test:{listed}/; "
                      f"{CURL} http://other.test:{unlisted}/")
    assert f"hello from {listed}" in said, said
    assert f"hello from {unlisted}" not in said, said
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        assert f"{var}=http://127.0.0.1:3128" in said.splitlines(), said
    assert "NO_PROXY=" in said.splitlines() and "no_proxy=" in said.splitlines(), said
    assert (f"kandev: refused 127.0.0.1:{unlisted}: a private address; to allow it: [network] host_ports ="
            f' ["127.0.0.1:{unlisted}"]') in said, said
    assert said.count(f"hello from {listed}") == 2, said  # the literal, and model.test (allowed, its address listed)
    assert f"refused other.test:{unlisted}: it resolves to 127.0.0.1, a private address" in said, said
    show = k.show(sid)
    assert show["network"]["refused"] == 2, show["network"]
    # The agent's own loopback is its own: a server it runs on the unlisted port answers it through the
    # proxy (as OpenCode's own server must), and the host's server on that port is still not reached.
    said = sh(k, sid, f"python3 -m http.server --bind 127.0.0.1 {unlisted} >/dev/null 2>&1 & "
                      f"for i in $(seq 100); do {CURL} -f -o /dev/null http://127.0.0.1:{unlisted}/ 2>/dev/null && break;"
                      f" sleep 0.1; done; echo own > own.txt; {CURL} http://127.0.0.1:{unlisted}/own.txt;"
                      f" {CURL} http://localhost:{unlisted}/own.txt")
    assert said.splitlines()[-2:] == ["own", "own"], said
    assert f"hello from {unlisted}" not in said, said


def test_issue_44_scenario_b_mode_none_gives_no_network_and_no_proxy_variable(
        kandev_factory: Any, short_tmp: Path, http_servers: list[_Server]) -> None:
    """Issue 44 scenario B: with ``mode = "none"`` neither the listed nor the unlisted server is
    reachable, and no proxy variable is set."""
    listed, unlisted = (port_of(s) for s in http_servers)
    k = kandev_factory(config_text=f'[network]\nmode = "none"\nhost_ports = ["127.0.0.1:{listed}"]\n')
    k.up()
    sid = start(k, short_tmp, "none")
    said = sh(k, sid, f"env | grep -ci proxy; {CURL} http://127.0.0.1:{listed}/; echo rc=$?; "
                      f"{CURL} --proxy http://127.0.0.1:3128 http://127.0.0.1:{unlisted}/; echo rc=$?")
    assert said.splitlines()[1] == "0", said
    assert "hello from" not in said, said
    assert said.count("rc=7") == 2, said  # curl: could not connect, both times


def test_issue_44_scenario_a_a_resumed_agent_is_in_a_namespace_of_its_own_again(
        kandev_factory: Any, short_tmp: Path, http_servers: list[_Server]) -> None:
    """Issue 44 scenario A (item 1: after resume): an agent given again to a stopped session
    (``kandev resume``) is in a network namespace of its own with its proxy: the host's loopback
    server is unreachable directly and through the proxy, the metadata address is refused."""
    port = port_of(http_servers[0])
    k = kandev_factory()
    k.up()
    sid = start(k, short_tmp, "resume")
    first = k.show(sid)["instance_id"]
    k.cli("session", "stop", sid)
    k.cli("resume", sid, timeout=180)
    assert k.show(sid)["instance_id"] != first
    said = sh(k, sid, f"{CURL} --noproxy '*' http://127.0.0.1:{port}/; echo direct=$?; "
                      f"{CURL} http://127.0.0.1:{port}/; {CURL} -o /dev/null -w '%{{http_code}}\\n' http://169.254.169.254/")
    assert "direct=7" in said and f"hello from {port}" not in said, said
    assert f"kandev: refused 127.0.0.1:{port}: a private address" in said and "403" in said.splitlines(), said
    assert k.show(sid)["network"]["refused"] == 2


def stream_lines(path: Path) -> int:
    return path.read_text(errors="replace").count("line ") if path.exists() else 0


def test_issue_44_scenario_c_the_proxy_serves_through_a_backend_sigkill_and_a_reload(
        kandev_factory: Any, short_tmp: Path, http_servers: list[_Server]) -> None:
    """Issue 44 scenario C: a ``curl`` streaming through the proxy from a listed server keeps
    receiving while the backend is SIGKILLed and started again (the proxy is the control server's);
    after ``kandev agentctl reload`` (a new process image) a new request through the proxy works
    at once."""
    port = port_of(http_servers[0])
    k = kandev_factory(config_text=f'[network]\nhost_ports = ["127.0.0.1:{port}"]\n',
                       KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    assert st["control_server"]["mode"] == "detached"
    sid = start(k, short_tmp, "c")
    out = short_tmp / "ws-c" / "stream.out"
    said = sh(k, sid, f"nohup curl -sSN http://127.0.0.1:{port}/stream > stream.out 2>&1 < /dev/null & echo started")
    assert "started" in said, said
    wait_until(lambda: stream_lines(out) >= 3, timeout=30)
    backend = int(st["backend"]["pid"])
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    seen = stream_lines(out)
    wait_until(lambda: stream_lines(out) >= seen + 5, timeout=30)  # still streaming, no backend at all
    st2 = k.up()
    assert st2["adoption"]["outcome"] == "adopted" and st2["recovery"]["retracked"] == 1
    seen = stream_lines(out)
    wait_until(lambda: stream_lines(out) >= seen + 3, timeout=30)
    assert "kandev:" not in out.read_text(errors="replace")
    reload = k.cli("agentctl", "reload", timeout=200)
    assert reload["outcome"] == "reexecuted", reload
    said = sh(k, sid, f"curl -sS -m 10 http://127.0.0.1:{port}/")
    assert f"hello from {port}" in said, said


@pytest.mark.parametrize(("config", "key", "value"), [
    ('[network]\nmode = "closed"\n', "network.mode", '"closed"'),
    ('[network]\nallow_hosts = ["exa mple.com"]\n', "network.allow_hosts", "exa mple.com"),
    ('[network]\nallow_hosts = ["example.com:99999"]\n', "network.allow_hosts", "99999"),
    ('[network]\nhost_ports = ["localhost:11434"]\n', "network.host_ports", "localhost:11434"),
    ('[network]\nallowed_hosts = ["example.com"]\n', "network.allowed_hosts", "allowed_hosts"),
    ('[agents.mock]\nnetwork = "everything"\n', "agents.mock.network", "everything"),
    ('[agents.mock]\nallow_hosts = ["*.*.example.com"]\n', "agents.mock.allow_hosts", "*.*.example.com"),
])
def test_issue_44_scenario_f_bad_network_keys_are_refused_at_start(
        kandev_factory: Any, config: str, key: str, value: str) -> None:
    """Issue 44 scenario F: an unknown or malformed network key is refused at start, naming the key,
    the value and why; nothing is started."""
    k = kandev_factory(config_text=config)
    with pytest.raises(CliError) as refused:
        k.up()
    message = refused.value.stderr + refused.value.stdout
    assert key in message and value in message, message
    assert re.search(r"accepted|not|unknown|must", message), message
    assert not (k.home / "run" / "backend.sock").exists()
