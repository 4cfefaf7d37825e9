from __future__ import annotations

import pytest

from fleet_sim.webui.store import GrantStore, Held


def test_grants_are_kept_per_client_and_never_shown() -> None:
    store = GrantStore()
    a, b = store.new_client_id(), store.new_client_id()
    assert a != b and len(a) >= 40
    store.put(a, Held("a07-s1.x", "secret-grant", "demo"))
    assert store.get(a, "a07-s1.x") == Held("a07-s1.x", "secret-grant", "demo")
    assert store.get(b, "a07-s1.x") is None
    assert store.get(None, "a07-s1.x") is None
    assert "secret-grant" not in repr(store.sessions(a))
    assert a in store and b not in store


def test_bounded_least_recently_used_first() -> None:
    store = GrantStore(max_clients=2, max_sessions=2)
    store.put("c1", Held("a07-s1.one", "g"))
    store.put("c1", Held("a07-s1.two", "g"))
    store.get("c1", "a07-s1.one")  # touched: "two" is now the oldest
    store.put("c1", Held("a07-s1.three", "g"))
    assert [h.session_id for h in store.sessions("c1")] == ["a07-s1.one", "a07-s1.three"]
    store.put("c2", Held("a07-s1.x", "g"))
    store.get("c1", "a07-s1.one")  # c2 is now the least recently used client
    store.put("c3", Held("a07-s1.y", "g"))
    assert "c1" in store and "c2" not in store and "c3" in store and len(store) == 2


def test_forget_and_replace() -> None:
    store = GrantStore()
    store.put("c", Held("a07-s1.x", "old"))
    store.put("c", Held("a07-s1.x", "new"))
    assert [h.grant for h in store.sessions("c")] == ["new"]
    assert store.forget("c", "a07-s1.x") and not store.forget("c", "a07-s1.x")
    assert not store.forget(None, "a07-s1.x")
    with pytest.raises(ValueError):
        GrantStore(max_clients=0)
