"""daemon.store.owner: a store remembers the installation that created it (Issue 10 item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.store.db import Store, sqlite_url
from daemon.store.owner import ForeignStore, check_store_owner, claim_store, describe_store, store_owner

A, B = "a" * 32, "b" * 32


def test_a_new_store_is_adopted_then_kept(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "kandev.db")
    check_store_owner(url, A, "x")  # no file yet: nothing to refuse
    assert not (tmp_path / "kandev.db").exists()  # and the check did not create it
    store = Store.open(url)
    try:
        assert store_owner(store.engine) is None  # an existing store without an id (older stores)
        assert claim_store(store.engine, A, "x") is True
        assert claim_store(store.engine, A, "x") is False  # the same installation: accepted, unchanged
        assert store_owner(store.engine) == A
    finally:
        store.close()
    check_store_owner(url, A, "x")


def test_another_installation_is_refused_naming_both(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "kandev.db")
    store = Store.open(url)
    try:
        claim_store(store.engine, A, describe_store(url))
        with pytest.raises(ForeignStore) as info:
            claim_store(store.engine, B, describe_store(url))
        assert store_owner(store.engine) == A  # unchanged
    finally:
        store.close()
    assert A in str(info.value) and B in str(info.value) and str(tmp_path / "kandev.db") in str(info.value)
    with pytest.raises(ForeignStore) as info:
        check_store_owner(url, B, describe_store(url))
    assert (info.value.owner, info.value.ours) == (A, B)


def test_describe_store_never_echoes_a_server_url() -> None:
    assert describe_store("postgresql://kandev:secret@db/kandev") == "named by database.url"
