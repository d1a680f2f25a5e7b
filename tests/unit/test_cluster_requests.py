"""The request queue between cluster hosts (daemon/backend/cluster/requests.py) on a real PostgreSQL:
each request is claimed once, even by backends racing for it; a request given up is never claimed;
one left ``running`` by a dead backend is answered ``request_interrupted``, never run again; the
NOTIFYs are delivered at commit (Issue 47 item 2)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from daemon.backend.cluster import requests
from daemon.store.models import ClusterRequest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sessions(postgres) -> Iterator[sessionmaker[Session]]:
    url = postgres.new_database()
    engine = create_engine(url, pool_size=20)
    ClusterRequest.__table__.create(engine)
    try:
        yield sessionmaker(engine, expire_on_commit=False)
    finally:
        engine.dispose()


def _enqueue(sessions: sessionmaker[Session], n: int, host: str = "b") -> list[int]:
    with sessions() as db:
        ids = [requests.enqueue(db, host=host, origin_host="a", op="prompt", args={"session_id": "s", "i": i})
               for i in range(n)]
        db.commit()
    return ids


def test_each_request_is_claimed_once_by_racing_backends(sessions):
    """Issue 47 item 2: eight claimers (as two backends woken twice each, and more) race for 200
    requests: every request is claimed exactly once, and in each claimer in id order."""
    ids = _enqueue(sessions, 200)
    claimed: list[list[int]] = [[] for _ in range(8)]
    go = threading.Barrier(8)

    def claimer(mine: list[int]) -> None:
        go.wait()
        while True:
            with sessions() as db:
                got = requests.claim(db, "b")
                db.commit()
            if got is None:
                return
            mine.append(got.id)

    threads = [threading.Thread(target=claimer, args=(c,)) for c in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [i for c in claimed for i in c]
    assert sorted(everything) == ids  # each once, none lost
    assert all(c == sorted(c) for c in claimed)
    assert sum(1 for c in claimed if c) >= 2  # they did race
    with sessions() as db:
        assert {r.state for r in db.query(ClusterRequest)} == {requests.RUNNING}


def test_a_locked_request_is_skipped_not_waited_for(sessions):
    """Issue 47 item 2: while one backend's claiming transaction holds the oldest request, another
    claims the next one at once (SKIP LOCKED), and never the held one."""
    first, second = _enqueue(sessions, 2)
    with sessions() as holder:
        held = requests.claim(holder, "b")
        assert held is not None and held.id == first
        with sessions() as other:
            got = requests.claim(other, "b")
            other.commit()
        assert got is not None and got.id == second
        holder.commit()
    with sessions() as db:
        assert requests.claim(db, "b") is None


def test_claim_takes_only_its_own_hosts_requests(sessions):
    _enqueue(sessions, 1, host="c")
    with sessions() as db:
        assert requests.claim(db, "b") is None


def test_a_request_given_up_is_never_claimed_and_one_claimed_is_not_given_up(sessions):
    """Issue 47 item 2: the requester's give-up and the owner's claim exclude each other."""
    gone, kept = _enqueue(sessions, 2)
    error = {"code": requests.HOST_UNREACHABLE, "message": "host b is unreachable", "retryable": True}
    with sessions() as db:
        assert requests.give_up(db, gone, error)
        db.commit()
    with sessions() as db:
        got = requests.claim(db, "b")
        db.commit()
    assert got is not None and got.id == kept
    with sessions() as db:
        assert not requests.give_up(db, kept, error)
        out = requests.outcome(db, gone)
    assert out is not None and out.state == requests.DONE and out.error == error


def test_a_request_left_running_is_answered_interrupted_not_run_again(sessions):
    """Issue 47 item 2: a backend that died between claim and answer leaves its request running;
    its next start answers it ``request_interrupted`` and nothing claims it again."""
    (rid,) = _enqueue(sessions, 1)
    with sessions() as db:
        assert requests.claim(db, "b") is not None
        db.commit()
    with sessions() as db:
        assert requests.answer_interrupted(db, "b") == [rid]
        db.commit()
    with sessions() as db:
        assert requests.claim(db, "b") is None
        out = requests.outcome(db, rid)
        assert not requests.finish(db, rid, result={"late": True})  # a late answer changes nothing
    assert out is not None and out.state == requests.DONE and out.error is not None
    assert out.error["code"] == requests.REQUEST_INTERRUPTED and "may or may not" in out.error["message"]


def test_notifications_are_delivered_at_commit(sessions, postgres):
    """Issue 47 item 2: ``kandev_requests`` names the target host and ``kandev_results`` the request,
    each only once its transaction committed."""
    url = make_url(str(sessions.kw["bind"].url))
    with psycopg.connect(host=url.query["host"], user=url.username, dbname=url.database, autocommit=True) as conn:
        conn.execute(f"LISTEN {requests.REQUESTS_CHANNEL}")
        conn.execute(f"LISTEN {requests.RESULTS_CHANNEL}")
        with sessions() as db:
            rid = requests.enqueue(db, host="b", origin_host="a", op="cancel", args={"session_id": "s"})
            assert list(conn.notifies(timeout=0.3)) == []  # not yet committed
            db.commit()
        (note,) = list(conn.notifies(timeout=5, stop_after=1))
        assert (note.channel, note.payload) == (requests.REQUESTS_CHANNEL, "b")
        with sessions() as db:
            requests.claim(db, "b")
            requests.finish(db, rid, result={"ok": True})
            db.commit()
        (note,) = list(conn.notifies(timeout=5, stop_after=1))
        assert (note.channel, note.payload) == (requests.RESULTS_CHANNEL, str(rid))
    with sessions() as db:
        out = requests.outcome(db, rid)
    assert out == requests.Outcome(requests.DONE, {"ok": True}, None)
