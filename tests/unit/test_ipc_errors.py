"""Unit tests for ipc.errors: wire round trips, retryable defaults, copy/pickle."""

from __future__ import annotations

import copy
import pickle

from ipc.errors import ErrorCode, IpcError


def test_wire_round_trip() -> None:
    err = IpcError(ErrorCode.NOT_FOUND, "no such session", retryable=False)
    back = IpcError.from_wire(err.to_wire())
    assert (back.code, back.message, back.retryable) == (ErrorCode.NOT_FOUND, "no such session", False)


def test_retryable_defaults() -> None:
    assert IpcError(ErrorCode.UNAVAILABLE, "x").retryable is True
    assert IpcError(ErrorCode.TIMEOUT, "x").retryable is True
    assert IpcError(ErrorCode.INVALID_ARGUMENT, "x").retryable is False
    assert IpcError(ErrorCode.INVALID_ARGUMENT, "x", retryable=True).retryable is True


def test_malformed_wire_error() -> None:
    assert IpcError.from_wire("nope").code == ErrorCode.INVALID_FRAME
    assert IpcError.from_wire({}).code == ErrorCode.INTERNAL


def test_copy_and_pickle_keep_the_fields() -> None:
    err = IpcError(ErrorCode.CONFLICT, "lost the race", retryable=True)
    for clone in (copy.copy(err), pickle.loads(pickle.dumps(err))):
        assert isinstance(clone, IpcError)
        assert (clone.code, clone.message, clone.retryable) == (err.code, err.message, err.retryable)
        assert str(clone) == str(err)
