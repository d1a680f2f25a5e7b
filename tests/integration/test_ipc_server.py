"""Contract tests: the real AsyncClient and SyncClient against a real IpcServer.

The server runs on its own event loop in a thread, on a socket in a 0700
tmp dir; clients use real AF_UNIX sockets (raw ones for malformed input).
Every wait is bounded (pytest-timeout, socket timeouts, polling deadlines).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from daemon.cli.call import connect as cli_connect
from ipc import (
    MAX_FRAME,
    AsyncClient,
    ConnectionContext,
    ErrorCode,
    Event,
    IpcError,
    IpcServer,
    Op,
    OpTable,
    SocketInUseError,
    SyncClient,
    codec_json,
    encode_frame,
    read_frame_sync,
)
from ipc.client import STREAM_QUEUE_BYTES, STREAM_QUEUE_MAX, EventStream
from ipc.codec_msgpack import decode_body, event_batch_frames, pack
from ipc.framing import ConnectionClosed, InvalidFrame, frame_of
from tests.support.waiting import eventually, wait_until
from tests.support.wire import read_frame_body

pytestmark = pytest.mark.timeout(60)

TABLE = OpTable(
    "ipc-test",
    (1, 3),
    [
        Op("echo", optional={"value": object}, auth=False),
        Op("add", required={"a": int, "b": int}, auth=False),
        Op("slow", required={"delay": float, "tag": str}, auth=False),
        Op("fail", required={"code": str}, auth=False),
        Op("crash", auth=False),
        Op("big", auth=False),
        Op("unsendable", auth=False),
        Op("login", required={"token": str}, auth=False),
        Op("secret", auth=True),
        Op("kick_others", auth=False),
        Op(
            "count",
            required={"n": int},
            optional={"size": int, "fail_at": int, "delay": float},
            auth=False,
            stream=True,
        ),
        Op("watch", auth=False, stream=True),
        Op("count_batched", required={"n": int, "frame_bytes": int}, optional={"bad_at": int}, auth=False,
           stream=True),
        # Plain-function handlers (answered inline, no task): the same contract as async ones.
        Op("sum", required={"a": int, "b": int}, optional={"pad": int}, auth=False),
        Op("sum_async", required={"a": int, "b": int}, optional={"pad": int}, auth=False),
        Op("refuse", required={"code": str}, auth=False),
        Op("explode", auth=False),
        Op("whisper", auth=True),
    ],
    capabilities=["streams", "echo"],
)


class Recorder:
    """What the handlers saw (written on the server thread, read by tests)."""

    def __init__(self) -> None:
        self.sent = 0  # events count() has sent so far
        self.frames = 0  # frames count_batched() sent
        self.concurrent = 0
        self.max_concurrent = 0
        self.watch_events: list[str] = []
        self.disconnects = 0


def make_handlers(rec: Recorder, server_ref: list[IpcServer]) -> dict[str, Any]:
    async def echo(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
        return args.get("value")

    async def add(ctx: ConnectionContext, args: dict[str, Any]) -> int:
        return args["a"] + args["b"]

    async def slow(ctx: ConnectionContext, args: dict[str, Any]) -> str:
        rec.concurrent += 1
        rec.max_concurrent = max(rec.max_concurrent, rec.concurrent)
        try:
            await asyncio.sleep(args["delay"])
        finally:
            rec.concurrent -= 1
        return args["tag"]

    async def fail(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        raise IpcError(args["code"], "refused on purpose")

    async def crash(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        raise RuntimeError("secret internals must not leak")

    async def big(ctx: ConnectionContext, args: dict[str, Any]) -> bytes:
        return b"x" * (MAX_FRAME + 1)

    async def unsendable(ctx: ConnectionContext, args: dict[str, Any]) -> object:
        return {"x": object()}

    async def login(ctx: ConnectionContext, args: dict[str, Any]) -> bool:
        ok = args["token"] == "letmein"
        if ok:
            ctx.state["authenticated"] = True
        return ok

    async def secret(ctx: ConnectionContext, args: dict[str, Any]) -> str:
        return "the secret"

    async def kick_others(ctx: ConnectionContext, args: dict[str, Any]) -> int:
        others = [c for c in server_ref[0].connections if c is not ctx]
        for c in others:
            c.close()
            c.close()  # idempotent
        return len(others)

    async def count(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        n, size, fail_at, delay = args["n"], args.get("size", 0), args.get("fail_at"), args.get("delay")
        if n < 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "n must be >= 0")
        await ctx.start_stream({"n": n})
        for i in range(n):
            if i == fail_at:
                raise IpcError(ErrorCode.AGENT_ERROR, f"failed at {i}")
            if delay:
                await asyncio.sleep(delay)
            await ctx.send_event(i, "tick", {"i": i, "pad": b"p" * size})
            rec.sent = i + 1

    async def count_batched(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        """``count``'s events, several per frame (``{events: [...]}``); ``bad_at``: that event's
        item is malformed (a seq that is not an integer)."""
        n, bad_at = args["n"], args.get("bad_at")
        await ctx.start_stream({"n": n})
        items = [(i, "tick", pack({"i": i})) for i in range(n)]
        frames = event_batch_frames(items, args["frame_bytes"])
        if bad_at is not None:
            frames = [frame_of(pack({"events": [[i if i != bad_at else "x", "tick", {"i": i}] for i in range(n)]}))]
        rec.frames = len(frames)
        await ctx.send_event_frames(frames)

    async def watch(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        await ctx.start_stream({"watching": True})
        try:
            await ctx.send_event(0, "hello", None)
            await asyncio.wait_for(ctx.closed.wait(), 30)
            rec.watch_events.append("closed-seen")
            await asyncio.sleep(30)  # cancelled by the server because the peer left
        except asyncio.CancelledError:
            rec.watch_events.append("cancelled")
            raise

    def sum_(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return {"sum": args["a"] + args["b"], "pad": b"p" * args.get("pad", 0)}

    async def sum_async(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return sum_(ctx, args)

    def refuse(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        raise IpcError(args["code"], "refused inline on purpose")

    def explode(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        raise RuntimeError("secret internals must not leak")

    def whisper(ctx: ConnectionContext, args: dict[str, Any]) -> str:
        return "the inline secret"

    return {
        "sum": sum_,
        "sum_async": sum_async,
        "refuse": refuse,
        "explode": explode,
        "whisper": whisper,
        "echo": echo,
        "add": add,
        "slow": slow,
        "fail": fail,
        "crash": crash,
        "big": big,
        "unsendable": unsendable,
        "login": login,
        "secret": secret,
        "kick_others": kick_others,
        "count": count,
        "count_batched": count_batched,
        "watch": watch,
    }


def authorize(ctx: ConnectionContext, op: Op) -> None:
    if not ctx.state.get("authenticated"):
        raise IpcError(ErrorCode.UNAUTHENTICATED, f"{op.name} needs an authenticated connection")


class ServerThread:
    """An IpcServer on its own event loop in a background thread."""

    def __init__(self, path: Path | str, **kwargs: Any) -> None:
        self.rec = Recorder()
        self.path = str(path)
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: IpcServer | None = None

    def start(self) -> ServerThread:
        self.thread.start()
        ref: list[IpcServer] = []

        async def create() -> IpcServer:
            kwargs = {"authorize": authorize, "on_disconnect": self._on_disconnect, **self.kwargs}
            server = IpcServer(self.path, TABLE, make_handlers(self.rec, ref), **kwargs)
            ref.append(server)
            await server.start()
            return server

        self.server = self.run(create())
        return self

    def _on_disconnect(self, ctx: ConnectionContext) -> None:
        self.rec.disconnects += 1

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 15) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def connection_count(self) -> int:
        async def count() -> int:
            assert self.server is not None
            return len(self.server.connections)

        return int(self.run(count()))

    def buffered(self) -> int:
        async def used() -> int:
            assert self.server is not None
            return self.server.buffered

        return int(self.run(used()))

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def server(sock_dir: Path) -> Iterator[ServerThread]:
    st = ServerThread(sock_dir / "ipc.sock", frame_timeout=1.0).start()
    try:
        yield st
    finally:
        st.stop()


def arun(coro: Coroutine[Any, Any, Any], timeout: float = 20) -> Any:
    """Run a client coroutine on a fresh loop in the test thread, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Raw:
    """A raw AF_UNIX client for sending arbitrary bytes."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, rid: Any, op: str, args: Any = None, v: Any = 1) -> None:
        self.send(encode_frame({"v": v, "id": rid, "op": op, "args": args if args is not None else {}}))

    def recv(self) -> dict[str, Any] | None:
        return read_frame_sync(self.sock)

    def is_closed(self) -> bool:
        """True if the server closed the connection (EOF or reset) within the socket timeout."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def assert_error(frame: dict[str, Any] | None, code: str, rid: Any) -> dict[str, Any]:
    assert frame is not None, "connection closed instead of an error response"
    assert frame["id"] == rid
    assert frame["ok"] is False
    assert frame["error"]["code"] == code, frame
    assert isinstance(frame["error"]["message"], str)
    assert isinstance(frame["error"]["retryable"], bool)
    return frame


def assert_alive(path: str) -> None:
    """A fresh client still gets answers."""
    with SyncClient(path, timeout=5) as c:
        assert c.call("add", {"a": 2, "b": 3}, timeout=5) == 5


# -- contract: hello and plain calls -------------------------------------------------


EXPECTED_HELLO = {
    "protocol": "ipc-test",
    "version": [1, 3],
    "capabilities": ["echo", "streams"],
    "ops": TABLE.names,
}


def test_hello_sync_and_async(server: ServerThread) -> None:
    with SyncClient(server.path) as c:
        assert c.server_hello == EXPECTED_HELLO
        assert c.call("hello", {"v": 1, "client": "test"}) == EXPECTED_HELLO

    async def main() -> dict[str, Any] | None:
        async with await AsyncClient.connect(server.path) as c:
            return c.server_hello

    assert arun(main()) == EXPECTED_HELLO


VALUES = [None, True, 0, -1, 2**63 - 1, 1.25, "", "héllo ✓", b"\x00\xff", [1, [2, [3]]], {"k": {"n": [None]}}]


def test_sync_client_calls(server: ServerThread) -> None:
    with SyncClient(server.path) as c:
        for value in VALUES:
            assert c.call("echo", {"value": value}) == value
        assert c.call("add", {"a": 40, "b": 2}) == 42
        assert c.call("echo") is None


def test_async_client_calls(server: ServerThread) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(server.path) as c:
            for value in VALUES:
                assert await c.call("echo", {"value": value}) == value
            assert await c.call("add", {"a": 40, "b": 2}, timeout=5) == 42

    arun(main())


def test_hello_can_be_skipped(server: ServerThread) -> None:
    with SyncClient(server.path, hello=False) as c:
        assert c.server_hello is None
        assert c.call("add", {"a": 1, "b": 1}) == 2


# -- contract: typed errors ----------------------------------------------------


@pytest.mark.parametrize("client", ["sync", "async"])
def test_typed_errors(server: ServerThread, client: str) -> None:
    cases: list[tuple[str, dict[str, Any] | None, str]] = [
        ("no_such_op", None, ErrorCode.UNKNOWN_OP),
        ("add", {"a": 1}, ErrorCode.INVALID_ARGUMENT),
        ("add", {"a": 1, "b": "2"}, ErrorCode.INVALID_ARGUMENT),
        ("add", {"a": True, "b": 2}, ErrorCode.INVALID_ARGUMENT),
        ("fail", {"code": ErrorCode.NOT_FOUND}, ErrorCode.NOT_FOUND),
        ("fail", {"code": ErrorCode.SESSION_GUARDED}, ErrorCode.SESSION_GUARDED),
        ("crash", None, ErrorCode.INTERNAL),
        ("big", None, ErrorCode.FRAME_TOO_LARGE),
        ("unsendable", None, ErrorCode.INTERNAL),
        ("secret", None, ErrorCode.UNAUTHENTICATED),
    ]

    def check(errors: list[IpcError]) -> None:
        for (op, _, code), err in zip(cases, errors, strict=True):
            assert err.code == code, (op, err)
        crash = errors[6]
        assert "secret internals" not in crash.message  # generic message, traceback only in the log
        assert errors[5].retryable is True  # session_guarded is retryable by default
        assert errors[4].message == "refused on purpose"

    if client == "sync":
        with SyncClient(server.path) as c:
            errors = []
            for op, args, _ in cases:
                with pytest.raises(IpcError) as info:
                    c.call(op, args)
                errors.append(info.value)
            check(errors)
            assert c.call("add", {"a": 1, "b": 2}) == 3  # the connection is still usable
    else:

        async def main() -> None:
            async with await AsyncClient.connect(server.path) as c:
                errors = []
                for op, args, _ in cases:
                    with pytest.raises(IpcError) as info:
                        await c.call(op, args)
                    errors.append(info.value)
                check(errors)
                assert await c.call("add", {"a": 1, "b": 2}) == 3

        arun(main())
    assert_alive(server.path)


def test_authorize_hook_is_per_connection(server: ServerThread) -> None:
    with SyncClient(server.path) as a, SyncClient(server.path) as b:
        with pytest.raises(IpcError) as info:
            a.call("secret")
        assert info.value.code == ErrorCode.UNAUTHENTICATED
        assert a.call("login", {"token": "wrong"}) is False
        assert a.call("login", {"token": "letmein"}) is True
        assert a.call("secret") == "the secret"
        with pytest.raises(IpcError) as info:
            b.call("secret")
        assert info.value.code == ErrorCode.UNAUTHENTICATED


# -- concurrency ---------------------------------------------------------------


def test_concurrent_async_calls_are_multiplexed(server: ServerThread) -> None:
    async def main() -> float:
        async with await AsyncClient.connect(server.path) as c:
            start = time.monotonic()
            tags = [f"t{i}" for i in range(20)]
            results = await asyncio.gather(*(c.call("slow", {"delay": 0.3, "tag": t}) for t in tags))
            assert results == tags
            return time.monotonic() - start

    assert arun(main()) < 3.0  # 20 x 0.3 s run concurrently, not one after the other


def test_many_clients_in_parallel(server: ServerThread) -> None:
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with SyncClient(server.path) as c:
                for i in range(50):
                    assert c.call("add", {"a": k, "b": i}, timeout=10) == k + i
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_responses_come_back_out_of_order(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        raw.request(1, "slow", {"delay": 0.6, "tag": "a"})
        raw.request(2, "slow", {"delay": 0.05, "tag": "b"})
        raw.request("three", "slow", {"delay": 0.3, "tag": "c"})
        frames = [raw.recv() for _ in range(3)]
        assert [f["id"] for f in frames if f] == [2, "three", 1]
        assert [f["result"] for f in frames if f] == ["b", "c", "a"]
    finally:
        raw.close()


def test_inflight_requests_are_bounded_per_connection(sock_dir: Path) -> None:
    st = ServerThread(sock_dir / "bounded.sock", max_inflight_per_connection=2).start()
    try:
        raw = Raw(st.path)
        for i in range(6):
            raw.request(i, "slow", {"delay": 0.1, "tag": str(i)})
        got = sorted(f["id"] for f in (raw.recv() for _ in range(6)) if f)
        assert got == list(range(6))
        assert st.rec.max_concurrent == 2
        raw.close()
    finally:
        st.stop()


@pytest.mark.parametrize("client", ["sync", "async"])
def test_call_timeout_then_late_reply_is_ignored(server: ServerThread, client: str) -> None:
    if client == "sync":
        with SyncClient(server.path) as c:
            with pytest.raises(IpcError) as info:
                c.call("slow", {"delay": 0.5, "tag": "late"}, timeout=0.1)
            assert info.value.code == ErrorCode.TIMEOUT
            assert c.call("slow", {"delay": 0.6, "tag": "next"}, timeout=5) == "next"
    else:

        async def main() -> None:
            async with await AsyncClient.connect(server.path) as c:
                with pytest.raises(IpcError) as info:
                    await c.call("slow", {"delay": 0.5, "tag": "late"}, timeout=0.1)
                assert info.value.code == ErrorCode.TIMEOUT
                assert await c.call("slow", {"delay": 0.6, "tag": "next"}, timeout=5) == "next"

        arun(main())


def test_lost_connection_fails_pending_and_later_calls(sock_dir: Path) -> None:
    st = ServerThread(sock_dir / "lost.sock").start()
    stopped = False

    async def main() -> None:
        nonlocal stopped
        c = await AsyncClient.connect(st.path)
        pending = asyncio.ensure_future(c.call("slow", {"delay": 20.0, "tag": "never"}))
        await asyncio.sleep(0)  # let the request go out
        await asyncio.to_thread(st.stop)
        stopped = True
        with pytest.raises(IpcError) as info:
            await asyncio.wait_for(pending, 10)
        assert info.value.code == ErrorCode.UNAVAILABLE
        with pytest.raises(IpcError) as info:
            await c.call("echo")
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert c.closed
        await c.close()

    try:
        arun(main())
    finally:
        if not stopped:
            st.stop()


def test_server_initiated_close(server: ServerThread) -> None:
    with SyncClient(server.path) as victim, SyncClient(server.path) as admin:
        assert victim.call("echo", {"value": 1}) == 1
        assert admin.call("kick_others") == 1
        with pytest.raises(IpcError) as info:
            victim.call("echo", {"value": 2})
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert admin.call("echo", {"value": 3}) == 3


def test_half_closed_peer_still_gets_its_responses(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        raw.request(1, "slow", {"delay": 0.2, "tag": "x"})
        raw.request(2, "add", {"a": 1, "b": 1})
        raw.sock.shutdown(socket.SHUT_WR)
        got = {f["id"]: f["result"] for f in (raw.recv(), raw.recv()) if f}
        assert got == {1: "x", 2: 2}
        assert raw.recv() is None
    finally:
        raw.close()


@pytest.mark.parametrize("client", ["sync", "async"])
def test_plain_handlers_answer_like_async_ones(server: ServerThread, client: str) -> None:
    """A plain ``def`` handler (answered inline) has the same contract: result, typed error,
    internal error without internals, authorization."""

    async def calls(c: Any, call: Any) -> list[Any]:
        out: list[Any] = [await call(c, "sum", {"a": 2, "b": 3})]
        for op, args in (("refuse", {"code": ErrorCode.NOT_FOUND}), ("explode", {}), ("whisper", {}),
                         ("sum", {"a": "x", "b": 1})):
            try:
                await call(c, op, args)
            except IpcError as exc:
                out.append((exc.code, exc.message))
        await call(c, "login", {"token": "letmein"})
        out.append(await call(c, "whisper", {}))
        return out

    if client == "sync":
        with SyncClient(server.path) as sc:
            async def sync_call(c: Any, op: str, args: dict[str, Any]) -> Any:
                return c.call(op, args)
            got = asyncio.run(calls(sc, sync_call))
    else:
        async def main() -> list[Any]:
            async with await AsyncClient.connect(server.path) as ac:
                async def async_call(c: Any, op: str, args: dict[str, Any]) -> Any:
                    return await c.call(op, args)
                return await calls(ac, async_call)
        got = arun(main())
    assert got[0] == {"sum": 5, "pad": b""}
    assert got[1] == (ErrorCode.NOT_FOUND, "refused inline on purpose")
    assert got[2] == (ErrorCode.INTERNAL, "internal error in explode")
    assert got[3][0] == ErrorCode.UNAUTHENTICATED
    assert got[4][0] == ErrorCode.INVALID_ARGUMENT
    assert got[5] == "the inline secret"


def test_a_plain_handler_answers_while_an_async_one_waits(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        raw.request(1, "slow", {"delay": 0.5, "tag": "a"})
        raw.request(2, "sum", {"a": 1, "b": 2})
        frames = [raw.recv(), raw.recv()]
        assert [(f["id"], f["result"]) for f in frames if f] == [(2, {"sum": 3, "pad": b""}), (1, "a")]
    finally:
        raw.close()


@pytest.mark.parametrize("half_close", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_plain_handler_responses_to_a_peer_not_reading_arrive_once(
    server: ServerThread, half_close: bool, mixed: bool
) -> None:
    """Responses that fill the pipe wait for the peer (the server reads no more requests
    meanwhile), each once; only plain handlers: in order. Mixed with async handlers, whose
    responses hold the write path while they wait for the peer, a plain handler's response waits
    its turn in a task. A peer that half-closed after sending still gets them all, then EOF."""
    raw = Raw(server.path)
    n, pad = 48, 256 * 1024  # 12 MiB of responses: far past the socket and transport buffers
    try:
        for rid in range(1, n + 1):
            op = "sum_async" if mixed and rid % 2 else "sum"
            raw.request(rid, op, {"a": rid, "b": 1, "pad": pad})
        if half_close:
            raw.sock.shutdown(socket.SHUT_WR)
        got = []
        for _ in range(n):
            frame = raw.recv()
            assert frame is not None and frame["ok"] is True, frame
            got.append((frame["id"], frame["result"]["sum"], len(frame["result"]["pad"])))
        expected = [(rid, rid + 1, pad) for rid in range(1, n + 1)]
        assert (sorted(got) if mixed else got) == expected
        if half_close:
            assert raw.recv() is None
        else:
            raw.request(n + 1, "sum", {"a": 0, "b": 0})
            assert raw.recv() == {"id": n + 1, "ok": True, "result": {"sum": 0, "pad": b""}}
    finally:
        raw.close()


def test_max_connections(sock_dir: Path) -> None:
    st = ServerThread(sock_dir / "few.sock", max_connections=2).start()
    try:
        with SyncClient(st.path), SyncClient(st.path):
            with pytest.raises(IpcError) as info:
                SyncClient(st.path)
            assert info.value.code == ErrorCode.UNAVAILABLE
            assert info.value.retryable is True
        wait_until(lambda: st.connection_count() == 0, timeout=10)
        assert_alive(st.path)
    finally:
        st.stop()


# -- versions ------------------------------------------------------------------


def test_hello_version_mismatch_refused_by_both_clients(server: ServerThread) -> None:
    with pytest.raises(IpcError) as info:
        SyncClient(server.path, protocol_major=2)
    assert info.value.code == ErrorCode.INCOMPATIBLE_VERSION
    assert "1.3" in info.value.message

    with pytest.raises(IpcError) as info:
        arun(AsyncClient.connect(server.path, protocol_major=2))
    assert info.value.code == ErrorCode.INCOMPATIBLE_VERSION
    assert_alive(server.path)


def test_wrong_version_is_a_response_and_the_connection_stays_open(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        raw.request(1, "add", {"a": 1, "b": 2}, v=2)
        assert_error(raw.recv(), ErrorCode.INCOMPATIBLE_VERSION, 1)
        raw.request(2, "hello", {"v": 7})  # envelope v right, hello's v wrong
        assert_error(raw.recv(), ErrorCode.INCOMPATIBLE_VERSION, 2)
        raw.request(3, "hello", {"v": 1, "client": "raw"})
        assert raw.recv() == {"id": 3, "ok": True, "result": EXPECTED_HELLO}
    finally:
        raw.close()


# -- bad input: every refusal is typed, and the server keeps answering -------------------


def test_random_bytes(server: ServerThread) -> None:
    rng = random.Random(1234)
    for i in range(20):
        raw = Raw(server.path)
        try:
            blob = rng.randbytes(rng.randrange(1, 4096))
            if i % 2:  # a plausible small prefix so the body is parsed too
                blob = struct.pack(">I", len(blob)) + blob
            raw.send(blob)
            try:
                frame = raw.recv()  # a short prefix may leave an incomplete frame: refused after 1 s
            except (ConnectionClosed, ConnectionResetError):
                frame = None  # closed: an accepted refusal
            if frame is not None:
                assert frame["ok"] is False
                assert frame["error"]["code"] in (ErrorCode.INVALID_FRAME, ErrorCode.FRAME_TOO_LARGE)
        finally:
            raw.close()
        assert_alive(server.path)


def test_huge_length_prefix_refused_then_closed(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        raw.send(struct.pack(">I", 100 * 1024 * 1024) + b"\x80" * 100)
        assert_error(raw.recv(), ErrorCode.FRAME_TOO_LARGE, None)
        assert raw.is_closed()
    finally:
        raw.close()
    assert_alive(server.path)


@pytest.mark.parametrize(
    ("frame", "code", "rid"),
    [
        ({"v": 1, "id": 5, "op": "nope", "args": {}}, ErrorCode.UNKNOWN_OP, 5),
        ({"v": 1, "op": "echo"}, ErrorCode.INVALID_FRAME, None),  # no id
        ({"v": 1, "id": [1], "op": "echo"}, ErrorCode.INVALID_FRAME, None),  # unusable id
        ({"v": 1, "id": True, "op": "echo"}, ErrorCode.INVALID_FRAME, None),
        ({"v": 1, "id": 6}, ErrorCode.INVALID_FRAME, 6),  # no op
        ({"v": 1, "id": 7, "op": 12}, ErrorCode.INVALID_FRAME, 7),
        ({"id": 8, "op": "echo"}, ErrorCode.INVALID_FRAME, 8),  # no v
        ({"v": 0, "id": 9, "op": "echo"}, ErrorCode.INCOMPATIBLE_VERSION, 9),
        ({"v": 1, "id": 10, "op": "add", "args": [1, 2]}, ErrorCode.INVALID_ARGUMENT, 10),
        ({"v": 1, "id": 11, "op": "add", "args": {"a": 1}}, ErrorCode.INVALID_ARGUMENT, 11),
    ],
    ids=[
        "unknown-op",
        "missing-id",
        "list-id",
        "bool-id",
        "missing-op",
        "int-op",
        "missing-v",
        "wrong-v",
        "args-not-map",
        "missing-arg",
    ],
)
def test_bad_envelopes_refused_connection_stays_open(
    server: ServerThread, frame: dict[str, Any], code: str, rid: Any
) -> None:
    raw = Raw(server.path)
    try:
        raw.send(encode_frame(frame))
        assert_error(raw.recv(), code, rid)
        raw.request(99, "add", {"a": 1, "b": 1})  # same connection, still in sync
        assert raw.recv() == {"id": 99, "ok": True, "result": 2}
    finally:
        raw.close()
    assert_alive(server.path)


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2, 3]),
        msgpack.packb("just a string"),
        b"\xc1\xc1\xc1",
        b"",
        msgpack.packb({"v": 1, "id": 1, "op": "echo", "args": {"value": msgpack.ExtType(3, b"x")}}),
        msgpack.packb({1: 2}),
    ],
    ids=["list", "str", "garbage", "empty", "ext-type", "int-key"],
)
def test_undecodable_frames_refused_connection_stays_open(server: ServerThread, body: bytes) -> None:
    raw = Raw(server.path)
    try:
        raw.send(struct.pack(">I", len(body)) + body)
        assert_error(raw.recv(), ErrorCode.INVALID_FRAME, None)
        raw.request(1, "echo", {"value": "still here"})
        assert raw.recv() == {"id": 1, "ok": True, "result": "still here"}
    finally:
        raw.close()
    assert_alive(server.path)


def test_incomplete_frame_is_refused_after_the_frame_timeout(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        start = time.monotonic()
        raw.send(struct.pack(">I", 1000) + b"\x81")  # a frame that never completes
        frame = assert_error(raw.recv(), ErrorCode.INVALID_FRAME, None)
        assert "incomplete frame" in frame["error"]["message"]
        assert 0.9 < time.monotonic() - start < 4.5
        assert raw.is_closed()
    finally:
        raw.close()
    assert_alive(server.path)


def test_frame_sent_in_pieces_within_the_timeout_is_served(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        data = encode_frame({"v": 1, "id": 1, "op": "echo", "args": {"value": "x" * 5000}})
        for i in range(0, len(data), 1000):
            raw.send(data[i : i + 1000])
            time.sleep(0.1)  # paced sending (total 0.6 s, under the 1 s frame timeout)
        assert raw.recv() == {"id": 1, "ok": True, "result": "x" * 5000}
    finally:
        raw.close()


def test_truncated_frame_then_disconnect(server: ServerThread) -> None:
    raw = Raw(server.path)
    raw.send(encode_frame({"v": 1, "id": 1, "op": "echo", "args": {}})[:7])
    raw.close()
    wait_until(lambda: server.connection_count() == 0, timeout=10)
    assert_alive(server.path)


def test_many_bad_clients_at_once_do_not_stall_good_ones(server: ServerThread) -> None:
    stallers = [Raw(server.path) for _ in range(10)]
    try:
        for s in stallers:
            s.send(struct.pack(">I", 1000) + b"\x81")  # a frame that never completes
        assert_alive(server.path)
    finally:
        for s in stallers:
            s.close()


# -- admitted peers that misbehave: idle connections, buffer cap (Issue 10 item 7) -------------


@pytest.fixture
def idle_server(sock_dir: Path) -> Iterator[ServerThread]:
    exempt = lambda ctx: ctx.state.get("authenticated") is True  # noqa: E731
    st = ServerThread(sock_dir / "idle.sock", frame_timeout=1.0, idle_timeout=0.5, idle_exempt=exempt).start()
    try:
        yield st
    finally:
        st.stop()


def test_an_idle_connection_is_told_and_closed(idle_server: ServerThread) -> None:
    """Issue 10 item 7: no request and no byte for the idle timeout -> ``idle_timeout``, closed."""
    raw = Raw(idle_server.path)
    try:
        start = time.monotonic()
        frame = assert_error(raw.recv(), ErrorCode.IDLE_TIMEOUT, None)
        assert frame["error"]["retryable"] is True
        assert time.monotonic() - start >= 0.45
        assert raw.is_closed()
    finally:
        raw.close()
    wait_until(lambda: idle_server.connection_count() == 0, timeout=10)


def test_a_request_in_flight_or_a_stream_is_never_idle(idle_server: ServerThread) -> None:
    with SyncClient(idle_server.path, timeout=5) as c:
        assert c.call("slow", {"delay": 1.5, "tag": "long"}, timeout=10) == "long"  # 3 x the idle timeout
        assert c.call("add", {"a": 1, "b": 1}, timeout=5) == 2  # the clock restarted at the response

    async def stream_outlives_the_idle_timeout() -> None:
        c = await AsyncClient.connect(idle_server.path)
        stream = await c.stream("watch")
        assert await stream.__anext__() == Event(0, "hello", None)
        await asyncio.sleep(1.5)  # nothing is sent either way: the stream stays open
        assert idle_server.connection_count() == 1
        await stream.close()

    arun(stream_outlives_the_idle_timeout())


def test_an_exempt_connection_may_stay_idle(idle_server: ServerThread) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(idle_server.path)
        assert await c.call("login", {"token": "letmein"}) is True
        await asyncio.sleep(1.5)
        assert await c.call("secret") == "the secret"
        await c.close()

    arun(main())


def test_a_frame_past_the_buffer_cap_is_refused_and_the_server_keeps_serving(sock_dir: Path) -> None:
    """Issue 10 item 7: total buffered bytes per server are capped; past the cap, ``buffers_full``."""
    st = ServerThread(sock_dir / "capped.sock", frame_timeout=5.0, buffer_limit=1024 * 1024).start()
    holders = [Raw(st.path) for _ in range(3)]
    try:
        for raw in holders[:2]:  # each declares 4 MiB and sends 400 KB of it: ~512 KiB buffered each
            raw.send(struct.pack(">I", 4 * 1024 * 1024) + b"\x80" * 400_000)
        wait_until(lambda: st.buffered() >= 2 * 400_000, timeout=10)
        holders[2].send(struct.pack(">I", 4 * 1024 * 1024) + b"\x80" * 400_000)
        frame = assert_error(holders[2].recv(), ErrorCode.BUFFERS_FULL, None)
        assert frame["error"]["retryable"] is True
        assert holders[2].is_closed()
        assert st.buffered() <= 1024 * 1024
        assert_alive(st.path)  # small requests still fit in a connection's initial buffer
        for raw in holders[:2]:
            raw.close()
        wait_until(lambda: st.buffered() == 0 and st.connection_count() == 0, timeout=10)
    finally:
        for raw in holders:
            raw.close()
        st.stop()


# -- streams -------------------------------------------------------------------


def test_stream_delivers_events_in_order_then_ends(server: ServerThread) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": 100})
        assert stream.result == {"n": 100}
        with pytest.raises(RuntimeError):
            await c.call("echo")
        events = [e async for e in stream]
        assert [e.seq for e in events] == list(range(100))
        assert events[0] == Event(0, "tick", {"i": 0, "pad": b""})
        await stream.close()

    arun(main())
    wait_until(lambda: server.connection_count() == 0, timeout=10)


def test_stream_after_authenticated_calls(server: ServerThread) -> None:
    async def main() -> list[int]:
        c = await AsyncClient.connect(server.path)
        assert await c.call("login", {"token": "letmein"}) is True
        async with await c.stream("count", {"n": 3}) as stream:
            return [e.seq async for e in stream]

    assert arun(main()) == [0, 1, 2]


def test_stream_error_before_start_is_a_response(server: ServerThread) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(server.path)
        with pytest.raises(IpcError) as info:
            await c.stream("count", {"n": -1})
        assert info.value.code == ErrorCode.INVALID_ARGUMENT
        assert c.closed

    arun(main())
    assert_alive(server.path)


def test_stream_error_after_start_ends_the_iteration_with_it(server: ServerThread) -> None:
    async def main() -> list[int]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": 10, "fail_at": 4})
        seen = []
        with pytest.raises(IpcError) as info:
            async for e in stream:
                seen.append(e.seq)
        assert info.value.code == ErrorCode.AGENT_ERROR
        await stream.close()
        return seen

    assert arun(main()) == [0, 1, 2, 3]


def test_stream_backpressure_then_full_delivery(server: ServerThread) -> None:
    n, size = 2000, 16 * 1024  # ~32 MiB: far beyond socket and transport buffers

    async def main() -> None:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": n, "size": size})

        # Not reading: the producer must stall well before the end.
        await _producer_stalled(server)
        assert 0 < server.rec.sent < n // 4

        seqs = [e.seq async for e in stream]
        assert seqs == list(range(n))
        assert server.rec.sent == n

    arun(main(), timeout=50)


def test_stream_iteration_can_be_cancelled_and_resumed(server: ServerThread) -> None:
    async def main() -> tuple[list[int], int]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": 3, "delay": 0.3})
        seqs, timeouts = [], 0
        deadline = time.monotonic() + 15
        while len(seqs) < 3 and time.monotonic() < deadline:
            try:
                event = await asyncio.wait_for(stream.__anext__(), 0.05)
            except TimeoutError:
                timeouts += 1
                continue
            seqs.append(event.seq)
        assert [e.seq async for e in stream] == []  # and then the server ends it
        return seqs, timeouts

    seqs, timeouts = arun(main())
    assert seqs == [0, 1, 2]
    assert timeouts > 0


async def _producer_stalled(server: ServerThread) -> None:
    """Wait until the server's producer stopped sending (the client read ahead as far as it may
    and the socket is full): nothing sent for 0.3 s."""
    def stalled() -> bool:
        before = server.rec.sent
        time.sleep(0.3)
        return server.rec.sent == before

    await asyncio.to_thread(wait_until, stalled, 15, 0.01, "producer stalled")


async def _drain_in_batches(stream: EventStream, limit: int) -> list[list[int]]:
    batches = []
    while batch := await stream.batch(limit):
        assert 1 <= len(batch) <= limit
        batches.append([e.seq for e in batch])
    return batches


def test_stream_batches_deliver_every_event_once_in_order(server: ServerThread) -> None:
    n, size = 2000, 16 * 1024  # beyond the socket buffers and the link's read-ahead: reading pauses

    async def main() -> list[list[int]]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": n, "size": size})

        await _producer_stalled(server)
        batches = await _drain_in_batches(stream, 500)
        assert await stream.batch(500) == []  # ended: stays ended
        return batches

    batches = arun(main(), timeout=50)
    assert [seq for batch in batches for seq in batch] == list(range(n))
    # one wake-up took what had been read ahead: as many frames as the queue's bounds let in
    assert len(batches[0]) >= min(STREAM_QUEUE_MAX, STREAM_QUEUE_BYTES // size)


@pytest.mark.parametrize("size", [0, 16 * 1024])
def test_a_stream_reads_ahead_of_its_consumer_up_to_its_bounds_in_frames_and_in_bytes(
        server: ServerThread, size: int) -> None:
    """While the consumer takes nothing, the link decodes ahead at most ``STREAM_QUEUE_MAX`` frames
    and (for large events) about ``STREAM_QUEUE_BYTES`` of them, then stops reading: the rest waits
    in the socket and in the server, and every event still arrives once, in order."""
    n = 3 * STREAM_QUEUE_MAX

    async def main() -> tuple[int, int, list[int]]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": n, "size": size})

        await _producer_stalled(server)
        link = stream._client._link
        queued, queued_bytes = len(link.queue), link.queued_bytes
        seqs = [seq for batch in await _drain_in_batches(stream, 10_000) for seq in batch]
        return queued, queued_bytes, seqs

    queued, queued_bytes, seqs = arun(main(), timeout=50)
    assert seqs == list(range(n))
    if size == 0:  # small events: the bound in frames
        assert queued == STREAM_QUEUE_MAX and queued_bytes < STREAM_QUEUE_BYTES
    else:  # large events: the bound in bytes (the frame that crossed it is the last one read)
        assert queued == -(-STREAM_QUEUE_BYTES // (queued_bytes // queued)) and queued < STREAM_QUEUE_MAX
        assert STREAM_QUEUE_BYTES <= queued_bytes < STREAM_QUEUE_BYTES + size + 1024


def test_stream_batch_returns_the_events_before_an_error_then_raises_it(server: ServerThread) -> None:
    async def main() -> list[int]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": 10, "fail_at": 4})
        seen: list[int] = []
        with pytest.raises(IpcError) as info:
            while batch := await stream.batch(100):
                seen.extend(e.seq for e in batch)
        assert info.value.code == ErrorCode.AGENT_ERROR
        assert await stream.batch(100) == []  # closed after the error
        return seen

    assert arun(main()) == [0, 1, 2, 3]


@pytest.mark.parametrize("frame_bytes", [1, 200, 1 << 20])
def test_events_batched_in_frames_arrive_once_in_order_through_next_and_batch(
        server: ServerThread, frame_bytes: int) -> None:
    """A server may put several events in one frame (``codec_msgpack.event_batch_frames``, the
    control server's ``attach`` with ``batched``): one event per frame (1 byte), a few (200 bytes),
    or all of them in one. The stream yields each once, in order, whether taken one by one or in
    batches smaller than a frame (the rest of a frame waits for the next call)."""
    n = 300

    async def main() -> tuple[list[int], list[int], int]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count_batched", {"n": n, "frame_bytes": frame_bytes})
        one_by_one = [(await stream.__anext__()).seq for _ in range(5)]
        in_batches = [seq for batch in await _drain_in_batches(stream, 7) for seq in batch]
        return one_by_one, in_batches, server.rec.frames

    one_by_one, in_batches, frames = arun(main())
    assert one_by_one + in_batches == list(range(n))
    if frame_bytes == 1:
        assert frames == n  # each event alone: larger than the bound
    elif frame_bytes == 200:
        assert 1 < frames < n / 10
    else:
        assert frames == 1


def test_a_malformed_event_in_a_batch_frame_ends_the_stream_with_invalid_frame(server: ServerThread) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count_batched", {"n": 5, "frame_bytes": 1 << 20, "bad_at": 2})
        with pytest.raises(InvalidFrame):
            await stream.batch(10)
        assert await stream.batch(10) == []  # closed

    arun(main())


def test_stream_batch_wait_can_be_cancelled_without_losing_events(server: ServerThread) -> None:
    async def main() -> tuple[list[int], int]:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("count", {"n": 3, "delay": 0.3})
        seqs: list[int] = []
        timeouts = 0
        deadline = time.monotonic() + 15
        while len(seqs) < 3 and time.monotonic() < deadline:
            try:
                batch = await asyncio.wait_for(stream.batch(10), 0.05)
            except TimeoutError:
                timeouts += 1
                continue
            seqs.extend(e.seq for e in batch)
        assert await stream.batch(10) == []
        with pytest.raises(ValueError):
            await stream.batch(0)
        return seqs, timeouts

    seqs, timeouts = arun(main())
    assert seqs == [0, 1, 2]
    assert timeouts > 0


def test_stream_peer_leaving_is_detected(server: ServerThread) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(server.path)
        stream = await c.stream("watch")
        assert stream.result == {"watching": True}
        first = await stream.__anext__()
        assert first == Event(0, "hello", None)
        await stream.close()

    arun(main())
    wait_until(lambda: server.rec.watch_events == ["closed-seen", "cancelled"], timeout=10)
    wait_until(lambda: server.connection_count() == 0, timeout=10)
    assert server.rec.disconnects == 1  # on_disconnect ran for the stream connection


def test_requests_after_a_stream_request_are_not_dispatched(server: ServerThread) -> None:
    raw = Raw(server.path)
    try:
        stream_request = encode_frame({"v": 1, "id": 1, "op": "count", "args": {"n": 2}})
        ignored = encode_frame({"v": 1, "id": 2, "op": "add", "args": {"a": 1, "b": 1}})
        raw.send(stream_request + ignored)  # the second is ignored: the connection is a stream now
        frames = [raw.recv(), raw.recv(), raw.recv()]
        assert frames[0] == {"id": 1, "ok": True, "result": {"n": 2}}
        assert [f["seq"] for f in frames[1:] if f] == [0, 1]
        assert raw.recv() is None  # the handler returned: the server closed
    finally:
        raw.close()


# -- peer credentials ------------------------------------------------------------


def test_a_refused_peer_that_writes_at_once_still_reads_the_typed_refusal(sock_dir: Path) -> None:
    """The client sends hello as soon as it connects, often before the refusal arrives. The server
    half-closes and lingers, so the write never meets a vanished socket (EPIPE): every attempt
    gets permission_denied, never a bare unavailable (before the linger: ~9 % did)."""
    st = ServerThread(sock_dir / "strict2.sock", allowed_uids={12345}).start()
    try:
        async def attempts() -> list[str]:
            codes = []
            for _ in range(200):
                try:
                    await AsyncClient.connect(st.path)
                    codes.append("connected")
                except IpcError as exc:
                    codes.append(exc.code)
            return codes

        codes = arun(attempts(), timeout=120)
        assert set(codes) == {ErrorCode.PERMISSION_DENIED}, {c: codes.count(c) for c in set(codes)}
    finally:
        st.stop()


def test_peer_refused_by_uid_in_process(sock_dir: Path) -> None:
    st = ServerThread(sock_dir / "strict.sock", allowed_uids={12345}).start()
    try:
        with pytest.raises(IpcError) as info:
            SyncClient(st.path)
        assert info.value.code == ErrorCode.PERMISSION_DENIED
        with pytest.raises(IpcError) as info:
            arun(AsyncClient.connect(st.path))
        assert info.value.code == ErrorCode.PERMISSION_DENIED
        raw = Raw(st.path)
        assert_error(raw.recv(), ErrorCode.PERMISSION_DENIED, None)  # sent before any frame of ours
        assert raw.is_closed()
        raw.close()
    finally:
        st.stop()


CHILD = r"""
import json, socket, struct, sys
path, request = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
out = {}
s.connect(path)
out["connected"] = True
try:
    s.sendall(request)
except OSError as exc:
    out["send_error"] = exc.errno
data = b""
try:
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            out["eof"] = True
            break
        data += chunk
except OSError as exc:
    out["recv_error"] = exc.errno
out["data"] = data.hex()
print(json.dumps(out))
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A socket dir other uids can traverse (0755), outside pytest's 0700 tmp tree."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a client as another uid")
    d = Path(tempfile.mkdtemp(prefix="ipc-peer-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_child_as(uid: int, gid: int, groups: list[int] | None, path: str) -> dict[str, Any]:
    request = encode_frame({"v": 1, "id": 1, "op": "add", "args": {"a": 20, "b": 22}})
    group_args = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    cmd = ["setpriv", "--reuid", str(uid), "--regid", str(gid), *group_args]
    proc = subprocess.run(
        [*cmd, sys.executable, "-I", "-c", CHILD, path, request.hex()],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    data = bytes.fromhex(out["data"])
    out["frame"] = decode_body(data[4:]) if len(data) > 4 else None
    return out


def test_peer_of_another_uid_refused_by_so_peercred(shared_dir: Path) -> None:
    st = ServerThread(shared_dir / "ipc.sock", socket_mode=0o666).start()
    try:
        assert stat.S_IMODE(os.stat(st.path).st_mode) == 0o666  # the filesystem lets anyone connect
        out = run_child_as(65534, 65534, None, st.path)
        assert out["connected"] is True  # so the refusal below comes from SO_PEERCRED
        assert_error(out["frame"], ErrorCode.PERMISSION_DENIED, None)
        assert_alive(st.path)
    finally:
        st.stop()


def test_allowed_gids_admit_primary_and_supplementary_groups(shared_dir: Path) -> None:
    st = ServerThread(shared_dir / "ipc.sock", socket_mode=0o666, allowed_gids={65534, 4343}).start()
    try:
        ok = {"id": 1, "ok": True, "result": 42}
        assert run_child_as(65534, 65534, None, st.path)["frame"] == ok  # primary gid
        assert run_child_as(65534, 4242, [4343], st.path)["frame"] == ok  # supplementary group
        refused = run_child_as(65534, 4242, [4444], st.path)
        assert_error(refused["frame"], ErrorCode.PERMISSION_DENIED, None)
    finally:
        st.stop()


# -- the socket file -------------------------------------------------------------


def test_socket_mode_and_cleanup(server: ServerThread, sock_dir: Path) -> None:
    assert stat.S_ISSOCK(os.stat(server.path).st_mode)
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    server.stop()
    assert not os.path.exists(server.path)
    server.server = None  # already stopped; the fixture's stop() must not close it twice
    server.stop = lambda: None  # type: ignore[method-assign]


def test_live_socket_is_never_unlinked(server: ServerThread) -> None:
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.7 (Unix-socket form): an endpoint that answers is occupied."""
    inode = os.stat(server.path).st_ino

    async def second() -> None:
        other = IpcServer(server.path, TABLE, make_handlers(Recorder(), []))
        with pytest.raises(SocketInUseError):
            await other.start()

    arun(second())
    assert os.stat(server.path).st_ino == inode
    assert_alive(server.path)


def test_stale_socket_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays; nobody listens: ECONNREFUSED
    st = ServerThread(path).start()
    try:
        assert_alive(st.path)
    finally:
        st.stop()


def test_non_socket_file_is_not_replaced(sock_dir: Path) -> None:
    path = sock_dir / "file.sock"
    path.write_text("precious")

    async def main() -> None:
        with pytest.raises(FileExistsError):
            await IpcServer(path, TABLE, make_handlers(Recorder(), [])).start()

    arun(main())
    assert path.read_text() == "precious"


def test_close_leaves_a_successors_socket_alone(sock_dir: Path) -> None:
    path = sock_dir / "succ.sock"
    first = ServerThread(path).start()
    os.unlink(path)  # e.g. an operator removed it; a successor binds the same path
    second = ServerThread(path).start()
    try:
        first.stop()
        assert_alive(second.path)
    finally:
        second.stop()
    assert not path.exists()


@pytest.mark.parametrize("name", ["\0kandev", "@kandev"])
def test_abstract_socket_names_refused(name: str) -> None:
    with pytest.raises(ValueError, match="abstract"):
        IpcServer(name, TABLE, make_handlers(Recorder(), []))


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o720, 0o1777])
def test_group_or_world_writable_parent_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "loose"
    d.mkdir()
    d.chmod(mode)

    async def main() -> None:
        with pytest.raises(PermissionError, match="writable"):
            await IpcServer(d / "ipc.sock", TABLE, make_handlers(Recorder(), [])).start()

    arun(main())
    assert not (d / "ipc.sock").exists()


def test_missing_parent_refused(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            await IpcServer(tmp_path / "nope" / "ipc.sock", TABLE, make_handlers(Recorder(), [])).start()

    arun(main())


def test_table_must_not_redefine_hello_and_handlers_must_match() -> None:
    async def h(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        return None

    with pytest.raises(ValueError, match="hello"):
        IpcServer("/tmp/x.sock", OpTable("t", (1, 0), [Op("hello")]), {"hello": h})
    with pytest.raises(ValueError, match="missing"):
        IpcServer("/tmp/x.sock", OpTable("t", (1, 0), [Op("a"), Op("b")]), {"a": h})
    with pytest.raises(ValueError, match="not in table"):
        IpcServer("/tmp/x.sock", OpTable("t", (1, 0), [Op("a")]), {"a": h, "zz": h})

    def plain(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        return None

    with pytest.raises(ValueError, match="stream ops need an async handler: s"):
        IpcServer("/tmp/x.sock", OpTable("t", (1, 0), [Op("a"), Op("s", stream=True)]), {"a": plain, "s": plain})


# -- clients and unreachable servers -------------------------------------------------------


def test_sync_client_waits_out_a_full_accept_queue(sock_dir: Path) -> None:
    """A Unix-socket connect with a timeout fails at once (EAGAIN) while the server's accept queue is
    full; the CLI's client waits within its connect timeout instead of calling the server dead."""
    path = str(sock_dir / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    queued = []
    try:
        while True:  # fill the accept queue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        accepted: list[socket.socket] = []
        drain = threading.Timer(0.3, lambda: accepted.extend(listener.accept()[0] for _ in range(len(queued))))
        drain.start()
        start = time.monotonic()
        client = SyncClient(path, hello=False, timeout=5)
        assert time.monotonic() - start >= 0.25  # it waited for the queue to drain
        client.close()
        drain.join(5)
        for s in accepted:
            s.close()
    finally:
        for s in queued:
            s.close()
        listener.close()


def _queue_connects(path: str, most: int) -> list[socket.socket]:
    """Connect up to ``most`` non-blocking sockets without letting any event loop run (nothing is
    accepted meanwhile): as many as the listening socket's accept queue holds."""
    queued: list[socket.socket] = []
    while len(queued) < most:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        queued.append(s)
    return queued


def test_served_and_handed_over_listening_sockets_keep_the_listen_backlog(sock_dir: Path) -> None:
    """asyncio listens again on the socket it is given to serve, with a backlog of 100 unless told:
    IpcServer keeps ``LISTEN_BACKLOG`` (1024), on the socket it binds and on one handed over by
    ``stop_accepting``/``start_on`` (the control server's re-exec), so a burst of connections (or
    the clients of a re-exec) waits in the queue instead of being refused."""
    path = str(sock_dir / "backlog.sock")
    want = 300  # well above asyncio's default of 100, well below LISTEN_BACKLOG

    async def burst_waits(server: IpcServer) -> None:
        queued = _queue_connects(path, want)
        try:
            assert len(queued) == want, f"the accept queue held only {len(queued)} connections"
        finally:
            for s in queued:
                s.close()
        # the server accepts the closed peers and sees them go
        await eventually(lambda: not server.connections, 10, interval=0.01, message="every peer gone")

    async def main() -> None:
        first = IpcServer(path, OpTable("t", (1, 0), []), {})
        await first.start()
        try:
            await burst_waits(first)
            kept = first.stop_accepting()
            second = IpcServer(path, OpTable("t", (1, 0), []), {})
            await second.start_on(kept, first.identity)
            try:
                await burst_waits(second)
            finally:
                await second.close()
        finally:
            await first.close()

    arun(main())


def test_unreachable_socket_is_unavailable_naming_the_path(sock_dir: Path) -> None:
    missing = str(sock_dir / "missing.sock")
    stale = sock_dir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()
    for path in (missing, str(stale)):
        with pytest.raises(IpcError) as info:
            SyncClient(path, timeout=2)
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert path in info.value.message
        with pytest.raises(IpcError) as info:
            arun(AsyncClient.connect(path, timeout=2))
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert path in info.value.message


def test_sync_client_after_close(server: ServerThread) -> None:
    c = SyncClient(server.path)
    c.close()
    c.close()
    with pytest.raises(IpcError) as info:
        c.call("echo")
    assert info.value.code == ErrorCode.UNAVAILABLE


# -- contract: JSON for clients (ipc.codec_json; Issue 24 item 3) --------------------------------


@pytest.fixture
def json_server(sock_dir: Path) -> Iterator[ServerThread]:
    st = ServerThread(sock_dir / "json.sock", frame_timeout=1.0, accept_json=True).start()
    try:
        yield st
    finally:
        st.stop()


def json_request(rid: Any, op: str, args: Any = None) -> bytes:
    return codec_json.encode_frame({"v": 1, "id": rid, "op": op, "args": {} if args is None else args})


def recv_body(raw: Raw) -> bytes:
    """The next frame's body as it came, whatever its codec (read exactly: the next stays queued)."""
    body = read_frame_body(raw.sock)
    assert body is not None, "connection closed"
    return body


JSON_VALUES = [v for v in VALUES if not isinstance(v, bytes)]


def test_a_json_client_is_answered_in_json_beside_msgpack_clients(json_server: ServerThread) -> None:
    with SyncClient(json_server.path, json=True) as j, SyncClient(json_server.path) as m:
        assert j.server_hello == EXPECTED_HELLO
        for value in JSON_VALUES:
            assert j.call("echo", {"value": value}) == value
        assert j.call("add", {"a": 40, "b": 2}) == 42
        assert m.call("echo", {"value": b"\x00\xff"}) == b"\x00\xff"  # msgpack peers keep bytes
    raw = Raw(json_server.path)
    raw.send(json_request(1, "hello"))
    body = recv_body(raw)
    assert json.loads(body) == {"id": 1, "ok": True, "result": EXPECTED_HELLO}  # any JSON parser reads it
    raw.close()


def test_typed_errors_reach_a_json_client_and_bytes_are_never_turned_into_text(json_server: ServerThread) -> None:
    cases: list[tuple[str, dict[str, Any] | None, str]] = [
        ("no_such_op", None, ErrorCode.UNKNOWN_OP),
        ("add", {"a": 1, "b": "2"}, ErrorCode.INVALID_ARGUMENT),
        ("fail", {"code": ErrorCode.NOT_FOUND}, ErrorCode.NOT_FOUND),
        ("crash", None, ErrorCode.INTERNAL),
        ("unsendable", None, ErrorCode.INTERNAL),
        ("secret", None, ErrorCode.UNAUTHENTICATED),
        ("sum", {"a": 1, "b": 2}, ErrorCode.INTERNAL),  # its result holds bytes: JSON cannot carry them
        ("sum_async", {"a": 1, "b": 2}, ErrorCode.INTERNAL),
    ]
    with SyncClient(json_server.path, json=True) as c:
        for op, args, code in cases:
            with pytest.raises(IpcError) as info:
                c.call(op, args)
            assert info.value.code == code, (op, info.value)
        with pytest.raises(IpcError) as info:
            c.call("sum", {"a": 1, "b": 2})
        assert info.value.message == "result of sum not sendable"
        assert c.call("add", {"a": 1, "b": 2}) == 3  # the connection is still usable
    assert_alive(json_server.path)


def test_a_json_connection_refuses_other_codecs_and_bad_json_and_stays_in_sync(json_server: ServerThread) -> None:
    raw = Raw(json_server.path)
    raw.send(json_request(1, "hello"))
    assert json.loads(recv_body(raw))["ok"] is True
    for bad in (encode_frame({"v": 1, "id": 2, "op": "add", "args": {"a": 1, "b": 1}}),  # msgpack, after JSON
                struct.pack(">I", 10) + b'{"a":NaN}\n', struct.pack(">I", 3) + b"{}x"):
        raw.send(bad)
        body = recv_body(raw)
        assert body[:1] == b"{"  # the refusal is in the connection's codec
        assert_error(json.loads(body), ErrorCode.INVALID_FRAME, None)
    raw.send(json_request(3, "add", {"a": 2, "b": 3}))
    assert json.loads(recv_body(raw)) == {"id": 3, "ok": True, "result": 5}
    raw.close()


def test_a_msgpack_connection_of_a_json_server_stays_msgpack(json_server: ServerThread) -> None:
    raw = Raw(json_server.path)
    raw.request(1, "add", {"a": 1, "b": 1})
    assert raw.recv() == {"id": 1, "ok": True, "result": 2}
    raw.send(json_request(2, "add", {"a": 1, "b": 1}))  # JSON after msgpack: refused, in msgpack
    assert_error(raw.recv(), ErrorCode.INVALID_FRAME, None)
    raw.close()


def test_a_json_stream_delivers_its_events(json_server: ServerThread) -> None:
    raw = Raw(json_server.path)
    raw.send(json_request(1, "watch"))
    assert json.loads(recv_body(raw)) == {"id": 1, "ok": True, "result": {"watching": True}}
    assert json.loads(recv_body(raw)) == {"seq": 0, "kind": "hello", "data": None}
    raw.close()
    wait_until(lambda: "cancelled" in json_server.rec.watch_events, timeout=10)


def test_a_server_without_json_refuses_it_and_the_cli_falls_back_to_msgpack(server: ServerThread) -> None:
    """A backend of release 0.2.0 accepts only msgpack: it refuses the JSON hello as an invalid
    frame (in msgpack), and the CLI's connection (daemon.cli.call.connect) then speaks msgpack."""
    raw = Raw(server.path)
    raw.send(json_request(1, "hello"))
    assert_error(raw.recv(), ErrorCode.INVALID_FRAME, None)
    raw.close()
    with pytest.raises(IpcError) as info:
        SyncClient(server.path, json=True)
    assert info.value.code == ErrorCode.INVALID_FRAME
    with cli_connect(server.path) as c:
        assert c.call("add", {"a": 20, "b": 22}) == 42
        assert c.call("echo", {"value": b"\x01"}) == b"\x01"  # msgpack it is


def test_a_json_client_refused_at_connect_reads_why(sock_dir: Path) -> None:
    """A refused peer is told before it sent a frame, so in msgpack: the JSON client reads that too."""
    st = ServerThread(sock_dir / "strict.sock", allowed_uids={12345}, accept_json=True).start()
    try:
        with pytest.raises(IpcError) as info:
            SyncClient(st.path, json=True)
        assert info.value.code == ErrorCode.PERMISSION_DENIED
    finally:
        st.stop()
