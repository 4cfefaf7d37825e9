from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.errors import CorruptHistory, LockHeld, StorageUnavailable
from replica.history import read_history
from replica.locking import NoLocking, lock_is_free
from replica.sealing import RecordSealer
from replica.segments import encode_record, segment_name
from replica.store import LOCK_FILE, Committed, SessionStore, StoreConfig, Superseded
from replica.transcript import Message
from wire.names import parse_session_id

DEK = bytes(range(32))
SID = parse_session_id("a07-s3.sess1")


def turn(tag: str) -> list[Message]:
    return [
        Message(f"{tag}u", None, "user", f"hello {tag}", 1.0),
        Message(f"{tag}a", None, "assistant", f"hi {tag}", 2.0),
    ]


def ids(messages: list[Message]) -> list[str]:
    return [m.id for m in messages]


def test_commit_replay_and_takeover_seal(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    first = store.open("acme", SID, DEK)
    assert first.epoch == 1 and first.transcript.leaf_id is None
    outcome = first.commit(turn("t1"))
    assert isinstance(outcome, Committed) and outcome.leaf_id == "t1a"
    first.release()
    second = store.open("acme", SID, DEK)
    assert second.epoch == 2 and ids(second.transcript.messages) == ["t1u", "t1a"]
    assert second.transcript.messages[1].parent_id == "t1u"
    second.commit(turn("t2"))
    assert second.transcript.messages[2].parent_id == "t1a"
    second.release()
    history = store.read("acme", SID, DEK)
    assert [s.epoch for s in history.segments] == [1, 2]
    assert history.segments[1].seals_prev_at == history.segments[0].valid_end
    assert history.segments[0].bound == history.segments[0].valid_end
    assert history.transcript.leaf_id == "t2a" and history.batches == 2


def test_lock_is_per_session_and_per_description(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, StoreConfig(lock_wait_s=0.05))
    owner = store.open("acme", SID, DEK)
    with pytest.raises(LockHeld):
        store.open("acme", SID, DEK)  # same process, second description: still refused
    other = store.open("acme", parse_session_id("a07-s3.sess2"), DEK)
    # Closing an unrelated descriptor on the lock file must not drop an OFD lock.
    os.close(os.open(owner.directory / LOCK_FILE, os.O_RDONLY))
    assert not lock_is_free(owner.directory / LOCK_FILE)
    owner.release()
    assert lock_is_free(owner.directory / LOCK_FILE)
    store.open("acme", SID, DEK).release()
    other.release()


def test_bounded_lock_wait(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, StoreConfig(lock_wait_s=0.3))
    owner = store.open("acme", SID, DEK)
    started = time.monotonic()
    with pytest.raises(LockHeld, match="another replica"):
        store.open("acme", SID, DEK)
    assert 0.25 <= time.monotonic() - started < 5
    owner.release()


def test_stale_owner_is_fenced_and_its_bytes_ignored(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, locker=NoLocking())
    stale = store.open("acme", SID, DEK)
    assert isinstance(stale.commit(turn("a1")), Committed)
    fresh = store.open("acme", SID, DEK)  # as after a lapsed lease: the lock did not stop it
    outcome = stale.commit(turn("a2"))
    assert outcome == Superseded(epoch=1, successor=2, batch_included=False)
    size = (stale.directory / segment_name(1)).stat().st_size
    assert stale.commit(turn("a3")) == outcome  # never writes again
    assert (stale.directory / segment_name(1)).stat().st_size == size
    assert isinstance(fresh.commit(turn("b1")), Committed)
    history = store.read("acme", SID, DEK)
    assert ids(history.transcript.messages) == ["a1u", "a1a", "b1u", "b1a"]
    assert history.segments[0].ignored_bytes > 0
    stale.release()
    fresh.release()


def test_superseded_says_when_the_successor_kept_the_batch(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, locker=NoLocking())
    stale = store.open("acme", SID, DEK)
    stale.commit(turn("a1"))
    fresh = store.open("acme", SID, DEK)
    assert stale._successor() == Superseded(1, 2, batch_included=True)
    stale.release()
    fresh.release()


def test_reset_starts_a_new_conversation(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    owner = store.open("acme", SID, DEK)
    owner.commit(turn("a"))
    assert isinstance(owner.reset("a07-s3.archived"), Committed)
    assert owner.transcript.leaf_id is None
    owner.commit(turn("b"))
    owner.release()
    history = store.read("acme", SID, DEK)
    assert ids(history.transcript.messages) == ["bu", "ba"] and history.committed_messages == 4


def test_missing_or_foreign_segment_breaks_the_chain(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    for tag in ("a", "b", "c"):
        owner = store.open("acme", SID, DEK)
        owner.commit(turn(tag))
        owner.release()
    directory = store.directory("acme", SID)
    (directory / segment_name(2)).unlink()
    with pytest.raises(CorruptHistory, match="missing or foreign"):
        store.read("acme", SID, DEK)
    with pytest.raises(CorruptHistory):
        store.open("acme", SID, DEK)  # an owner refuses to build on a broken chain
    assert lock_is_free(directory / LOCK_FILE)


def test_wrong_key_and_truncated_sealed_segment(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    for tag in ("a", "b"):
        owner = store.open("acme", SID, DEK)
        owner.commit(turn(tag))
        owner.release()
    with pytest.raises(CorruptHistory):
        store.read("acme", SID, bytes(32))
    first = store.directory("acme", SID) / segment_name(1)
    first.write_bytes(first.read_bytes()[:-5])
    with pytest.raises(CorruptHistory, match="truncated"):
        store.read("acme", SID, DEK)


def test_no_plaintext_on_disk(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    owner = store.open("acme", SID, DEK)
    owner.commit([Message("m1", None, "user", "TOPSECRET-" * 20, 1.0, {"title": "SECRETTITLE"})])
    owner.release()
    for path in store.directory("acme", SID).iterdir():
        blob = path.read_bytes()
        assert b"TOPSECRET" not in blob and b"SECRETTITLE" not in blob and b"m1" not in blob


def test_unmounted_root_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(StorageUnavailable):
        SessionStore(tmp_path / "absent").open("acme", SID, DEK)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.integers(1, 3)),
        st.tuples(st.just("crash"), st.floats(0.0, 0.999)),
        st.tuples(st.just("takeover"), st.just(0)),
    ),
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions)
def test_random_histories_with_crashes_lose_no_committed_batch(
    tmp_path_factory: pytest.TempPathFactory, plan: list[tuple[str, float]]
) -> None:
    root = tmp_path_factory.mktemp("hist")
    store = SessionStore(root, locker=NoLocking())
    owner = store.open("acme", SID, DEK)
    sealer = RecordSealer.for_session(DEK, "acme", str(SID))
    acknowledged: list[str] = []
    counter = 0
    for op, arg in plan:
        if op == "commit" and owner.open:
            for _ in range(int(arg)):
                counter += 1
                outcome = owner.commit(turn(f"t{counter}-"))
                assert isinstance(outcome, Committed)
                acknowledged += [f"t{counter}-u", f"t{counter}-a"]
        elif op == "crash" and owner.open:
            # Die mid-append: part of a sealed record reaches the file, then nothing more.
            counter += 1
            record = encode_record(
                sealer,
                owner.epoch,
                owner._next_index,
                {"k": "b", "m": [m.to_wire() for m in turn(f"x{counter}")]},
            )
            cut = int(len(record) * arg)
            os.pwrite(owner._fd, record[:cut], owner._size)
            owner.release()
        elif op == "takeover":
            owner.release()
            owner = store.open("acme", SID, DEK)
            assert ids(owner.transcript.messages) == acknowledged
        if not owner.open:
            owner = store.open("acme", SID, DEK)
    owner.release()
    history = read_history(store.directory("acme", SID), sealer)
    assert ids(history.transcript.messages) == acknowledged
    epochs = [s.epoch for s in history.segments]
    assert epochs == list(range(1, len(epochs) + 1))


def test_a_parked_session_holds_one_descriptor_and_commits_on(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    owner = store.open("acme", SID, DEK)
    owner.commit(turn("a"))
    before = len(os.listdir("/proc/self/fd"))
    owner.park()
    assert owner.parked and len(os.listdir("/proc/self/fd")) == before - 1
    assert not lock_is_free(owner.directory / LOCK_FILE)  # still owned while parked
    assert isinstance(owner.commit(turn("b")), Committed)
    assert not owner.parked
    owner.park()
    owner.release()
    assert lock_is_free(owner.directory / LOCK_FILE)
    assert ids(store.read("acme", SID, DEK).transcript.messages) == ["au", "aa", "bu", "ba"]
