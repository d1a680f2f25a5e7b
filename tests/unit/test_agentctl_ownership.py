"""The control server's ownership state machine (``daemon.agentctl.ownership``) on a fake clock.

Credentials, rotation, confirmation (REQ-EXECUTORS-CONTROL-OWNERSHIP-002) and the unowned timer
(REQ-EXECUTORS-CONTROL-OWNERSHIP-003); docs/architecture.md#ownership explains both. No sockets: the server's wiring is proven by
``tests/integration/test_agentctl_ownership.py``. AC ids are cited where a test proves one.
"""

from __future__ import annotations

import itertools

import pytest

from daemon.agentctl import auth
from daemon.agentctl.ownership import CURRENT, SUPERSEDED, Ownership
from daemon.config.agentctl import resolve_unowned_period, validate_agentctl
from ipc.errors import ErrorCode, IpcError

C0 = bytes([0xC0]) * 32
PERIOD = 60.0
DRIVING_OPS = ("claim", "confirm_rotation", "prompt", "attach", "attach_many", "detach", "create_instance", "list_instances",
               "stop_instance", "cancel", "turn_status", "ack_turn", "ack_events", "respond_permission")


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def numbered_credentials():
    """A credential source whose n-th credential is ``bytes([n]) * 32`` (n from 1)."""
    counter = itertools.count(1)
    return lambda: bytes([next(counter)]) * 32


def make(period: float = PERIOD) -> tuple[Ownership, Clock]:
    clock = Clock()
    return Ownership(C0, period, clock=clock, new_credential=numbered_credentials()), clock


def refused(code: str, fn, *args):
    with pytest.raises(IpcError) as info:
        fn(*args)
    assert info.value.code == code, info.value
    return info.value


# ---------------------------------------------------------------- credentials and rotation


def test_launch_credential_is_confirmed_zero():
    own, _ = make()
    assert (own.highest, own.confirmed) == (0, True)
    assert own.authenticate(C0, "prompt") == CURRENT
    assert own.authenticate(C0, "rotate") == CURRENT
    assert own.authenticate(bytes(32), "rotate") is None
    assert own.authenticate("not bytes", "rotate") is None
    assert own.acceptable_ids() == {0}


def test_rotation_ids_strictly_increase():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.6: each new rotation draws the next id of one increasing sequence."""
    own, _ = make()
    ids = []
    credential = C0
    for _ in range(5):
        rotation = own.rotate(credential)
        assert not rotation.replay
        ids.append(rotation.rotation_id)
        credential = rotation.credential
        assert len(credential) == auth.CREDENTIAL_BYTES
    assert ids == [1, 2, 3, 4, 5]
    own.confirm(5)
    assert own.rotate(credential).rotation_id == 6


def test_rotation_draws_fresh_random_credentials_by_default():
    own = Ownership(C0, PERIOD)
    first = own.rotate(C0)
    second = own.rotate(first.credential)
    assert len({C0, first.credential, second.credential}) == 3


def test_replay_returns_the_same_pair_and_changes_nothing():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.10: presented with the credential the highest, unconfirmed
    rotation superseded, rotate answers the same (id, credential); no id drawn, the set unchanged."""
    own, _ = make()
    first = own.rotate(C0)
    before = (own.highest, own.confirmed, own.acceptable_ids())
    for _ in range(10):  # any number of retries converge
        again = own.rotate(C0)
        assert (again.rotation_id, again.credential, again.replay) == (first.rotation_id, first.credential, True)
        assert again.cut == frozenset()
        assert (own.highest, own.confirmed, own.acceptable_ids()) == before
    # A new rotation only when presented with the credential the highest rotation issued.
    assert own.rotate(first.credential).rotation_id == 2


def test_at_most_two_credentials_and_a_third_never_authenticates():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.8: only C_{n+1} (everything) and C_n (adoption and shutdown);
    every other credential, an earlier unconfirmed replacement included, authenticates nothing."""
    own, _ = make()
    r1 = own.rotate(C0)  # unconfirmed(1): {C1 current, C0 superseded}
    assert own.authenticate(r1.credential, "prompt") == CURRENT
    assert own.authenticate(C0, "rotate") == SUPERSEDED
    r2 = own.rotate(r1.credential)  # unconfirmed(2): {C2, C1}; C0 is out
    assert r2.cut == {0}  # connections under C0 must be closed: it authenticates nothing any more
    assert own.acceptable_ids() == {1, 2}
    for purpose in ("rotate", "ownership_shutdown", *DRIVING_OPS):
        assert own.authenticate(C0, purpose) is None, purpose
    assert own.authenticate(r1.credential, "rotate") == SUPERSEDED
    assert own.authenticate(r1.credential, "prompt") is None  # the earlier replacement lost full power
    refused(ErrorCode.UNAUTHENTICATED, own.rotate, C0)
    refused(ErrorCode.SUPERSEDED_CREDENTIAL, own.rotate_as, 0)
    # Three rotations in: still never more than two.
    own.rotate(r2.credential)
    assert len(own.acceptable_ids()) == 2
    assert len(own.prove(b"c" * 32, "ident", "inst")) == 2


def test_superseded_credential_only_rotates_and_shuts_down():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.7, AC-EXECUTORS-CONTROL-OWNERSHIP-002.9: during the
    window the superseded credential authenticates only another adoption attempt (rotate) or
    the ownership shutdown."""
    own, _ = make()
    own.rotate(C0)
    assert own.check(0, "rotate") == SUPERSEDED
    assert own.check(0, "ownership_shutdown") == SUPERSEDED
    for purpose in DRIVING_OPS:
        assert own.authenticate(C0, purpose) is None
        error = refused(ErrorCode.SUPERSEDED_CREDENTIAL, own.check, 0, purpose)
        assert purpose in error.message
    refused(ErrorCode.SUPERSEDED_CREDENTIAL, own.claim, 0)


def test_confirm_makes_the_superseded_credential_authenticate_nothing():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.1, AC-EXECUTORS-CONTROL-OWNERSHIP-002.7 (phase 2),
    AC-EXECUTORS-CONTROL-OWNERSHIP-002.2: after the confirmation every use of the superseded credential
    is refused, and its connections are named for closing."""
    own, _ = make()
    r1 = own.rotate(C0)
    confirmation = own.confirm(r1.rotation_id)
    assert (confirmation.changed, confirmation.cut) == (True, {0})
    assert own.acceptable_ids() == {1}
    for purpose in ("rotate", "ownership_shutdown", *DRIVING_OPS):
        assert own.authenticate(C0, purpose) is None
        refused(ErrorCode.SUPERSEDED_CREDENTIAL, own.check, 0, purpose)
    refused(ErrorCode.UNAUTHENTICATED, own.rotate, C0)
    assert own.prove(b"c" * 32, "i", "j") == [auth.server_proof(r1.credential, b"c" * 32, "i", "j")]
    assert own.authenticate(r1.credential, "prompt") == CURRENT


def test_earlier_repeated_and_unknown_confirmations():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.6: an earlier id is a no-op (a late confirmation never revokes
    a newer credential), a repeated one changes nothing after the first, one never issued is rejected."""
    own, clock = make()
    r1 = own.rotate(C0)
    r2 = own.rotate(r1.credential)
    state = (own.highest, own.confirmed, own.acceptable_ids())
    error = refused(ErrorCode.UNKNOWN_ROTATION, own.confirm, 3)
    assert "never issued" in error.message
    refused(ErrorCode.UNKNOWN_ROTATION, own.confirm, 10**9)
    refused(ErrorCode.INVALID_ARGUMENT, own.confirm, -1)
    refused(ErrorCode.INVALID_ARGUMENT, own.confirm, True)
    assert (own.highest, own.confirmed, own.acceptable_ids()) == state
    late = own.confirm(1)  # earlier: accepted, nothing happens
    assert (late.changed, late.cut) == (False, frozenset())
    assert own.authenticate(r1.credential, "rotate") == SUPERSEDED
    assert own.confirm(0).changed is False
    assert own.confirm(2).changed is True
    for k in (2, 2, 1, 0):
        repeated = own.confirm(k)
        assert (repeated.changed, repeated.cut) == (False, frozenset())
    assert own.acceptable_ids() == {2}
    assert own.authenticate(r2.credential, "prompt") == CURRENT
    assert own.authenticate(r1.credential, "rotate") is None
    renewed = own.last_renewal
    clock.advance(5)
    own.confirm(2)
    assert own.last_renewal == renewed  # a confirmation does not renew (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8)


def test_rotation_from_confirmed_needs_the_current_credential():
    own, _ = make()
    r1 = own.rotate(C0)
    own.confirm(1)
    refused(ErrorCode.UNAUTHENTICATED, own.rotate, C0)
    r2 = own.rotate(r1.credential)
    assert (r2.rotation_id, r2.replay, r2.cut) == (2, False, frozenset())
    assert own.rotate(r1.credential).credential == r2.credential  # and its replay


def test_connection_proofs_match_the_right_credential():
    """A connection authenticates with HMAC(cred, nonce, identity); the credential never travels."""
    own, _ = make()
    r1 = own.rotate(C0)
    nonce = auth.new_challenge()
    assert own.match_connection_proof(nonce, "id", auth.connection_proof(C0, nonce, "id")) == 0
    assert own.match_connection_proof(nonce, "id", auth.connection_proof(r1.credential, nonce, "id")) == 1
    assert own.match_connection_proof(nonce, "id", auth.connection_proof(bytes(32), nonce, "id")) is None
    other_nonce = auth.new_challenge()  # a proof for another connection's nonce (Issue 3 scenario G)
    assert own.match_connection_proof(nonce, "id", auth.connection_proof(C0, other_nonce, "id")) is None
    assert own.match_connection_proof(nonce, "id", auth.connection_proof(C0, nonce, "other")) is None
    assert own.match_connection_proof(nonce, "id", None) is None
    assert own.role(None) is None


def test_prove_answers_for_each_acceptable_credential_current_first():
    own, _ = make()
    r1 = own.rotate(C0)
    challenge = auth.new_challenge()
    assert own.prove(challenge, "i", "inst") == [
        auth.server_proof(r1.credential, challenge, "i", "inst"),
        auth.server_proof(C0, challenge, "i", "inst"),
    ]


def test_bad_construction_is_refused():
    with pytest.raises(ValueError):
        Ownership(b"short", PERIOD)
    with pytest.raises(ValueError):
        Ownership(C0, 0)
    own = Ownership(C0, PERIOD, new_credential=lambda: b"bad")
    with pytest.raises(ValueError):
        own.rotate(C0)


# ---------------------------------------------------------------- the unowned timer


def test_spawn_without_handshake_counts_from_process_start():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.8: a server whose handshake never completes expires one
    period after it started, so a backend dying mid-handshake leaks nothing."""
    own, clock = make()
    assert own.last_renewal == own.started_at == clock.now
    clock.advance(PERIOD - 0.001)
    assert not own.decide_unowned_shutdown()
    clock.advance(0.001)
    assert own.decide_unowned_shutdown()
    assert own.shutdown_reason == "unowned"


def test_expiry_is_now_minus_last_renewal_at_least_the_period():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.2: expired exactly when now - last_successful_renewal >= period."""
    own, clock = make()
    own.claim(0)
    start = clock.now
    assert not own.expired(start + PERIOD - 1e-6)
    assert own.expired(start + PERIOD)
    assert own.expired(start + PERIOD + 1)
    assert own.remaining(start + 15) == PERIOD - 15
    assert not own.shutting_down  # asking never decides


def test_exactly_three_operations_renew():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.8: claim, the bootstrap handshake and a successful rotation
    (its replay included) set last_renewal; confirmation, authentication checks, proofs do not."""
    own, clock = make()
    t0 = own.last_renewal

    clock.advance(10)
    assert own.bootstrap(0) is True  # first authentication with the launch credential
    assert own.last_renewal == clock.now
    clock.advance(10)
    assert own.bootstrap(0) is False  # only once
    assert own.last_renewal == t0 + 10

    clock.advance(10)
    own.claim(0)
    assert own.last_renewal == clock.now

    clock.advance(10)
    r1 = own.rotate(C0)
    assert own.last_renewal == clock.now
    clock.advance(10)
    own.rotate(C0)  # the replay renews too
    assert own.last_renewal == clock.now

    renewed = own.last_renewal
    clock.advance(10)
    own.check(1, "prompt")
    own.check(1, "attach")
    own.check(1, "list_instances")
    own.authenticate(r1.credential, "prompt")
    own.prove(b"c" * 32, "i", "j")
    own.match_connection_proof(b"n" * 32, "i", b"x" * 32)
    own.confirm(1)
    own.bootstrap(0)  # no bootstrap once a rotation happened
    own.bootstrap(1)
    assert own.last_renewal == renewed


def test_refused_renewals_never_shorten_the_period():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.3: expiry depends only on the last successful renewal on the
    server's monotonic clock; failed attempts change nothing."""
    own, clock = make()
    own.rotate(C0)
    own.confirm(1)
    renewed = own.last_renewal
    clock.advance(30)
    refused(ErrorCode.SUPERSEDED_CREDENTIAL, own.claim, 0)
    refused(ErrorCode.UNAUTHENTICATED, own.rotate, bytes(32))
    refused(ErrorCode.UNKNOWN_ROTATION, own.confirm, 7)
    assert own.last_renewal == renewed
    assert not own.decide_unowned_shutdown()
    clock.advance(PERIOD - 30)
    assert own.decide_unowned_shutdown()


def test_claims_every_quarter_period_keep_it_owned_for_many_periods():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.2 (Issue 3 scenario D, second half): renewing every period/4 (< period/3)
    never lets it expire, even with two consecutive failed renewals; once renewals stop, it expires."""
    own, clock = make()
    own.bootstrap(0)
    interval = PERIOD / 4
    assert interval < PERIOD / 3
    for tick in range(1, 10 * 4 + 1):  # ten periods
        clock.advance(interval)
        if tick % 7 in (3, 4):  # two consecutive renewals lost on the way (failed on the backend side)
            continue
        own.claim(0)
        for _ in range(4):  # the server's own checks, about every second
            assert not own.decide_unowned_shutdown(clock.now)
    assert not own.shutting_down
    clock.advance(PERIOD - 0.5)
    assert not own.decide_unowned_shutdown()
    clock.advance(0.5)
    assert own.decide_unowned_shutdown()


def test_the_shutdown_decision_is_a_one_way_latch():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.9: decided once; afterwards every claim and adoption attempt
    (rotate, its replay, a confirmation) is refused with shutting_down and nothing cancels it."""
    own, clock = make()
    r1 = own.rotate(C0)
    clock.advance(PERIOD)
    assert own.decide_unowned_shutdown() is True
    assert own.decide_unowned_shutdown() is False  # taken once
    refused(ErrorCode.SHUTTING_DOWN, own.claim, 1)
    refused(ErrorCode.SHUTTING_DOWN, own.rotate, r1.credential)
    refused(ErrorCode.SHUTTING_DOWN, own.rotate, C0)  # the replay too
    refused(ErrorCode.SHUTTING_DOWN, own.confirm, 1)
    assert own.bootstrap(0) is False
    assert own.begin_shutdown("ownership_shutdown") is False  # already stopping
    assert own.shutting_down and own.shutdown_reason == "unowned"
    assert own.highest == 1 and not own.confirmed  # the refused attempts changed nothing
    # Credentials still authenticate (ownership_shutdown must keep working), but renew nothing.
    assert own.check(0, "ownership_shutdown") == SUPERSEDED


def test_a_claim_strictly_before_the_decision_prevents_it():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.9: a claim accepted before the decision moves last_renewal."""
    own, clock = make()
    clock.advance(PERIOD - 0.001)
    own.claim(0)
    clock.advance(0.001)
    assert not own.decide_unowned_shutdown()
    assert not own.shutting_down
    clock.advance(PERIOD)
    assert own.decide_unowned_shutdown()


def test_other_shutdowns_latch_too():
    own, _ = make()
    assert own.begin_shutdown("ownership_shutdown") is True
    assert own.begin_shutdown("signal") is False
    assert own.shutdown_reason == "ownership_shutdown"
    refused(ErrorCode.SHUTTING_DOWN, own.claim, 0)
    assert own.decide_unowned_shutdown(own.started_at + 10 * PERIOD) is False


@pytest.mark.parametrize(
    ("period", "idle", "expected", "adjusted"),
    [
        (600.0, 3600.0, 600.0, False),  # default pair: already shorter
        (600.0, 0.0, 600.0, False),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.6: reaping off, unchanged
        (600.0, 300.0, 150.0, True),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.4: half the idle timeout
        (30.0, 0.0, 60.0, True),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: floor
        # AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: the floor wins over the ordering, which cannot be met
        (600.0, 60.0, 60.0, True),
    ],
)
def test_the_resolved_period_feeds_the_timer(period, idle, expected, adjusted):
    resolved = validate_agentctl(100, period, idle)
    assert resolved.unowned_period == expected
    assert bool(resolved.notes) is adjusted
    assert resolve_unowned_period(period, idle)[0] == expected
    own = Ownership(C0, resolved.unowned_period, clock=Clock())
    assert own.period_s == expected
