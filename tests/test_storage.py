"""One conformance suite for every storage adapter, plus what only the file adapter promises."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import storage_of

from durably_py.errors import CorruptLogError, LeaseLostError, RunNotFoundError, ValidationError
from durably_py.storage import (
    LOG_VERSION,
    FileStorage,
    Lease,
    Log,
    MemoryStorage,
    RunInfo,
    SqliteStorage,
    Storage,
    validate_run_id,
)
from durably_py.storage.file import LOOK_EVERY

LONG = 3600.0
BAD_IDS: list[Any] = ["../x", "a/b", "x\x00", "r1\n", "", ".", "..", "a" * 200, 7, None, b"abc", "a..b", "-x"]


def header(run_id: str, **extra: Any) -> bytes:
    """A run header line as the kernel writes it."""
    record = {"t": "run", "v": LOG_VERSION, "run_id": run_id, "workflow": "wf", "key": None, "created_at": "2024"}
    return msgspec.json.encode(record | extra) + b"\n"


def line(**record: Any) -> bytes:
    """One record line."""
    return msgspec.json.encode(record) + b"\n"


@pytest.fixture(params=["file", "memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    adapter = storage_of(request.param, tmp_path, request)
    yield adapter
    adapter.close()


@pytest.fixture
def fs(tmp_path: Path) -> Any:
    adapter = FileStorage(tmp_path / "state")
    yield adapter
    adapter.close()


def started(store: Any, run_id: str = "r1", owner: str = "me") -> Lease:
    """Create and claim a run."""
    store.create(run_id, header(run_id))
    lease = store.claim(run_id, owner, LONG)
    assert lease is not None
    return lease


def kinds(records: list[dict[str, Any]]) -> list[str]:
    return [r["t"] for r in records]


# -- conformance: every adapter ------------------------------------------------------------------------------


def test_is_a_storage(store: Any) -> None:
    assert isinstance(store, Storage)
    assert isinstance(store.fsyncs, int)
    assert store.compact_above_bytes is None or store.compact_above_bytes > 0


def test_compact_above_bytes_defaults(tmp_path: Path) -> None:
    assert FileStorage(tmp_path).compact_above_bytes == 1_048_576
    assert FileStorage(tmp_path, compact_above_bytes=None).compact_above_bytes is None
    assert MemoryStorage().compact_above_bytes is None
    assert SqliteStorage(tmp_path / "d.db").compact_above_bytes is None


def test_create_read_round_trip(store: Any) -> None:
    store.create("r1", header("r1", key="nightly/../x"))
    log = store.read("r1")
    assert isinstance(log, Log)
    assert log.torn is None
    assert [(r["t"], r["run_id"], r["workflow"], r["key"]) for r in log.records] == [("run", "r1", "wf", "nightly/../x")]
    assert store.size("r1") == len(header("r1", key="nightly/../x"))


def test_duplicate_create_is_rejected(store: Any) -> None:
    store.create("r1", header("r1"))
    with pytest.raises(ValidationError, match="already exists"):
        store.create("r1", header("r1"))
    assert len(store.read("r1").records) == 1


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b'{"t":"run"}',
        b'{"t":"step"}\n',
        b"[1]\n",
        b'{"t":"run","run_id":"other"}\n',
        "str\n",
        b'{"t":"run"}\n{}\n',
    ],
)
def test_create_rejects_bad_headers(store: Any, bad: Any) -> None:
    with pytest.raises(ValidationError):
        store.create("r1", bad)
    assert store.read("r1") is None


def test_unknown_run(store: Any) -> None:
    assert store.read("nope") is None
    assert store.held("nope") is False
    assert store.lookup("some key") is None
    with pytest.raises(RunNotFoundError):
        store.claim("nope", "me", LONG)
    with pytest.raises(RunNotFoundError):
        store.size("nope")
    assert store.list_runs() == []


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_invalid_run_ids_are_rejected_everywhere(store: Any, bad: Any) -> None:
    with pytest.raises(ValidationError):
        validate_run_id(bad)
    with pytest.raises(ValidationError):
        store.create(bad, header("r1"))
    for call in (
        store.read,
        store.held,
        store.size,
        lambda r: store.claim(r, "me", LONG),
        lambda r: store.bind("k", r),
    ):
        with pytest.raises(ValidationError):
            call(bad)
    assert store.list_runs() == []


def test_claim_epochs_increase_and_claims_are_recorded(store: Any) -> None:
    first = started(store, owner="alice")
    assert first.epoch == 1 and first.owner == "alice" and first.run_id == "r1"
    store.release(first)
    second = store.claim("r1", "bob", LONG)
    assert second is not None and second.epoch == 2
    records = store.read("r1").records
    assert kinds(records) == ["run", "claim", "claim"]
    assert [(r["epoch"], r["owner"]) for r in records[1:]] == [(1, "alice"), (2, "bob")]
    assert all(r["at"].endswith("+00:00") for r in records[1:])


def test_second_claim_while_held(store: Any) -> None:
    lease = started(store)
    assert store.held("r1") is True
    assert store.claim("r1", "other", LONG) is None
    assert store.claim("r1", "me", LONG) is None
    assert kinds(store.read("r1").records) == ["run", "claim"]
    store.release(lease)
    assert store.held("r1") is False
    assert store.claim("r1", "other", LONG).epoch == 2


def test_amend_appends_to_an_unheld_run_without_claiming_it(store: Any) -> None:
    lease = started(store)
    store.append(lease, line(t="step", i=0))
    store.release(lease)
    seen: list[Any] = []

    def pause(records: list[Any], where: str) -> bytes:
        seen.append((kinds(records), where))
        return line(t="pause")

    fsyncs = store.fsyncs
    assert store.amend("r1", pause) is True
    assert seen and seen[0][0] == ["run", "claim", "step"] and "r1" in seen[0][1]
    assert store.fsyncs == fsyncs + 1  # durable once it returns
    assert kinds(store.read("r1").records) == ["run", "claim", "step", "pause"]
    assert store.info("r1").epoch == 1 and store.info("r1").last == {"t": "pause"}  # no new attempt
    assert store.held("r1") is False
    assert store.amend("r1", lambda records, where: None) is True  # nothing chosen: nothing written
    assert kinds(store.read("r1").records) == ["run", "claim", "step", "pause"]
    assert store.size("r1") == len(header("r1")) + sum(len(line(**r)) for r in store.read("r1").records[1:])
    again = store.claim("r1", "other", LONG)
    assert again is not None and again.epoch == 2  # the next real claim is attempt 2
    store.append(again, line(t="step", i=1))
    assert kinds(store.read("r1").records) == ["run", "claim", "step", "pause", "claim", "step"]
    store.release(again)
    assert store.amend("r1", lambda records, where: line(t="end", status="cancelled")) is True
    assert store.info("r1").epoch == 2
    assert [info.run_id for info in store.list_runs(state="cancelled")] == ["r1"]  # the catalog knows it ended
    assert store.count_runs(state="open") == 0


def test_amend_refuses_a_held_run_and_writes_nothing_it_should_not(store: Any) -> None:
    lease = started(store)
    called: list[int] = []
    assert store.amend("r1", lambda records, where: called.append(1) or line(t="pause")) is False
    assert called == [] and kinds(store.read("r1").records) == ["run", "claim"]
    store.append(lease, line(t="step"))  # the holder's lease is untouched
    store.release(lease)

    def refuse(records: list[Any], where: str) -> list[Any]:
        raise CorruptLogError(f"{where} is not to my liking", path=where)

    with pytest.raises(CorruptLogError):
        store.amend("r1", lambda records, where: line(t="pause"), check=refuse)
    with pytest.raises(ValidationError):
        store.amend("r1", lambda records, where: b'{"t":"pause"}')  # not a complete line
    assert kinds(store.read("r1").records) == ["run", "claim", "step"]
    with pytest.raises(RunNotFoundError):
        store.amend("nope", lambda records, where: line(t="pause"))
    assert store.held("r1") is False


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_amend_takes_the_lease_from_a_lapsed_owner(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = storage_of(kind, tmp_path, request)
    store.create("r1", header("r1"))
    old = store.claim("r1", "me", 0.05)
    time.sleep(0.1)
    assert store.amend("r1", lambda records, where: line(t="pause")) is True
    with pytest.raises(LeaseLostError):
        store.append(old, line(t="step", late=True))
    assert store.heartbeat(old, LONG) is False
    assert kinds(store.read("r1").records) == ["run", "claim", "pause"]
    new = store.claim("r1", "other", LONG)
    assert new is not None and new.epoch == 2
    store.close()


def test_append_round_trip_in_order(store: Any) -> None:
    lease = started(store)
    before = store.size("r1")
    store.append(lease, line(t="step", i=0))
    assert store.size("r1") == before + len(line(t="step", i=0))
    store.append(lease, line(t="step", i=1) + line(t="step", i=2, v={"a": [1, "é", None]}))
    records = store.read("r1").records
    assert kinds(records) == ["run", "claim", "step", "step", "step"]
    assert [r["i"] for r in records[2:]] == [0, 1, 2]
    assert records[-1]["v"] == {"a": [1, "é", None]}


@pytest.mark.parametrize("bad", [b"", b'{"t":"x"}', "text\n"])
def test_append_needs_complete_lines(store: Any, bad: Any) -> None:
    lease = started(store)
    with pytest.raises(ValidationError):
        store.append(lease, bad)
    assert kinds(store.read("r1").records) == ["run", "claim"]


def test_damaged_appended_lines_are_torn_or_corrupt(store: Any) -> None:
    lease = started(store)
    store.append(lease, b"not json\n")
    log = store.read("r1")
    assert kinds(log.records) == ["run", "claim"]
    assert log.torn is not None and "(9 bytes) at line 3 of" in log.torn
    store.release(lease)
    lease = store.claim("r1", "me", LONG)
    assert lease is not None and lease.epoch == 2
    log = store.read("r1")
    assert kinds(log.records) == ["run", "claim", "claim"] and log.torn is None
    store.append(lease, b"[1]\n" + line(t="step"))
    with pytest.raises(CorruptLogError, match="line 4 of") as caught:
        store.read("r1")
    assert caught.value.line == 4
    store.release(lease)
    with pytest.raises(CorruptLogError):
        store.claim("r1", "me", LONG)
    assert store.held("r1") is False


def test_stale_lease_cannot_write(store: Any) -> None:
    old = started(store)
    store.release(old)
    with pytest.raises(LeaseLostError):
        store.append(old, line(t="step"))
    with pytest.raises(LeaseLostError):
        store.sync(old)
    assert store.heartbeat(old, LONG) is False
    new = store.claim("r1", "other", LONG)
    assert new is not None and new.epoch == 2
    with pytest.raises(LeaseLostError):
        store.append(old, line(t="step"))
    with pytest.raises(LeaseLostError):
        store.rewrite(old, header("r1"))
    store.release(old)
    assert store.held("r1") is True
    store.append(new, line(t="step"))
    assert store.heartbeat(new, LONG) is True
    assert kinds(store.read("r1").records) == ["run", "claim", "claim", "step"]


def test_lease_from_another_adapter_is_not_current(store: Any) -> None:
    started(store)
    foreign = Lease("r1", "me", 1)
    with pytest.raises(LeaseLostError):
        store.append(foreign, line(t="step"))
    assert store.heartbeat(foreign, LONG) is False


def test_rewrite_replaces_atomically_and_appends_continue(store: Any) -> None:
    lease = started(store)
    for i in range(50):
        store.append(lease, line(t="step", i=i, pad="x" * 40))
    big = store.size("r1")
    compacted = header("r1") + line(t="snapshot", upto=49)
    store.rewrite(lease, compacted)
    assert store.size("r1") == len(compacted) < big
    assert kinds(store.read("r1").records) == ["run", "snapshot"]
    store.append(lease, line(t="step", i=50))
    assert store.heartbeat(lease, LONG) is True
    assert kinds(store.read("r1").records) == ["run", "snapshot", "step"]
    store.release(lease)
    assert store.claim("r1", "next", LONG).epoch == 2


@pytest.mark.parametrize("bad", [b"", b'{"t":"snapshot"}\n', b'{"t":"run"}\n{"t"', b'{"t":"run"}\n[1]\n{}\n'])
def test_rewrite_rejects_bad_data_and_keeps_the_log(store: Any, bad: bytes) -> None:
    lease = started(store)
    with pytest.raises(ValidationError):
        store.rewrite(lease, bad)
    assert kinds(store.read("r1").records) == ["run", "claim"]
    store.append(lease, line(t="step"))


def test_bind_and_lookup(store: Any) -> None:
    store.create("r1", header("r1"))
    store.create("r2", header("r2"))
    identities = ["nightly", "a/b/c", "../../etc/passwd", "..", "/", "wf\x01" + "x" * 600, "ключ ✓"]
    for identity in identities:
        assert store.bind(identity, "r1") is True
        assert store.lookup(identity) == "r1"
    assert store.bind("a/b/c", "r2", expect="r1") is True
    assert store.lookup("a/b/c") == "r2"
    assert store.lookup("a/b") is None
    for bad in ["", "x\x00", None, 3]:
        with pytest.raises(ValidationError):
            store.bind(bad, "r1")
        with pytest.raises(ValidationError):
            store.lookup(bad)


def test_bind_is_a_compare_and_swap(store: Any) -> None:
    assert store.bind("job", "r1") is True
    assert store.bind("job", "r2") is False  # expected nothing, but r1 is bound
    assert store.bind("job", "r2", expect="r3") is False
    assert store.lookup("job") == "r1"
    assert store.bind("job", "r2", expect="r1") is True
    assert store.lookup("job") == "r2"


def test_lookup_many_answers_each_identity_in_order(store: Any) -> None:
    """One answer per identity, in the order asked, duplicates included: what `lookup` of each says."""
    identities = ["nightly", "a/b/c", "../../etc/passwd", "..", "/", "wf\x01" + "x" * 600, "ключ ✓"]
    for number, identity in enumerate(identities):
        assert store.bind(identity, f"r{number}") is True
    assert store.bind("a/b/c", "moved", expect="r1") is True
    asked = ["unbound", *identities, "a/b", "nightly", "ключ ✓", "unbound", "nightly"]
    expected = [None, "r0", "moved", "r2", "r3", "r4", "r5", "r6", None, "r0", "r6", None, "r0"]
    assert store.lookup_many(asked) == expected
    assert store.lookup_many(asked) == [store.lookup(identity) for identity in asked]
    assert store.lookup_many(["unbound"]) == [None] and store.lookup_many(["ключ ✓"]) == ["r6"]
    assert store.lookup_many([]) == []


def test_lookup_many_answers_more_identities_than_one_statement_binds(store: Any) -> None:
    """1,200 identities (more than one SQLite statement takes), bound ones at every chunk's edges, each asked twice."""
    bound = {0, 1, 250, 499, 500, 501, 998, 999, 1000, 1001, 1198, 1199}
    for number in bound:
        assert store.bind(f"child:p:{number}", f"c{number}") is True
    asked = [f"child:p:{number}" for number in range(1200)]
    expected = [f"c{number}" if number in bound else None for number in range(1200)]
    assert store.lookup_many(asked) == expected
    assert store.lookup_many(asked[::-1] + asked) == expected[::-1] + expected


@pytest.mark.parametrize("bad", ["", "x\x00", None, 3, b"key"])
def test_lookup_many_rejects_what_lookup_rejects(store: Any, bad: Any) -> None:
    assert store.bind("fine", "r1") is True
    with pytest.raises(ValidationError) as one:
        store.lookup(bad)
    for batch in ([bad], ["fine", bad], ["fine", "unbound", bad, "fine"]):
        with pytest.raises(ValidationError) as many:
            store.lookup_many(batch)
        assert type(many.value) is type(one.value)
        assert (many.value.message, many.value.hint, many.value.docs) == (one.value.message, one.value.hint,
                                                                          one.value.docs)
    assert store.lookup_many(["fine"]) == ["r1"]


def test_sqlite_lookup_many_is_one_select_per_500_identities(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "d.db")
    assert store.lookup_many([]) == [] and store._conn is None  # nothing asked: the database is not opened
    assert store.bind("child:p:7", "c7") is True
    selects: list[str] = []
    store._db().set_trace_callback(lambda sql: selects.append(sql) if sql.startswith("SELECT") else None)
    asked = [f"child:p:{number}" for number in range(1001)] + ["child:p:7"]
    assert store.lookup_many(asked) == [None] * 7 + ["c7"] + [None] * 993 + ["c7"]
    assert len(selects) == 3
    store.close()


def test_create_bound_binds_then_creates_in_order_and_stops_at_a_lost_binding(store: Any) -> None:
    from durably_py.storage.base import NewRun

    runs = [NewRun(f"c{i}", header(f"c{i}", workflow="kid", parent="p"), f"child:p:{i}") for i in range(3)]
    assert store.create_bound(runs) is None
    assert sorted(i.run_id for i in store.list_runs(workflow="kid", parent="p")) == ["c0", "c1", "c2"]
    assert store.count_runs(parent="p") == 3
    assert [store.lookup(f"child:p:{i}") for i in range(3)] == ["c0", "c1", "c2"]
    assert [store.read(f"c{i}").records[0]["run_id"] for i in range(3)] == ["c0", "c1", "c2"]
    assert {"c0", "c1", "c2"} <= set(store.due(10))
    assert store.bind("child:p:4", "gone") is True  # bound to a run that is not there: rebound with expect
    later = [NewRun("c3", header("c3"), "child:p:3"), NewRun("c4", header("c4"), "child:p:4", expect="gone"),
             NewRun("c5", header("c5"), "child:p:0"), NewRun("c6", header("c6"), "child:p:6")]
    assert store.create_bound(later) == "child:p:0"  # bound to c0 already: c5 and what follows are not created
    assert store.lookup("child:p:3") == "c3" and store.lookup("child:p:4") == "c4"
    assert store.lookup("child:p:0") == "c0" and store.lookup("child:p:6") is None
    assert store.read("c4") is not None and store.read("c5") is None and store.read("c6") is None
    assert store.create_bound([]) is None


def test_create_bound_of_one_identity_twice_in_a_batch_acts_as_binds_in_order(store: Any) -> None:
    """The second bind of an identity in one batch sees the first: it needs it as its `expect`."""
    from durably_py.storage.base import NewRun

    twice = [NewRun("d0", header("d0"), "dup"), NewRun("d1", header("d1"), "dup"), NewRun("d2", header("d2"), "x")]
    assert store.create_bound(twice) == "dup"
    assert store.lookup("dup") == "d0" and store.read("d1") is None and store.read("d2") is None
    chained = [NewRun("e0", header("e0"), "chain"), NewRun("e1", header("e1"), "chain", expect="e0")]
    assert store.create_bound(chained) is None
    assert store.lookup("chain") == "e1" and store.read("e0") is not None and store.read("e1") is not None


def test_create_bound_of_a_run_id_that_exists_is_an_error_naming_it(store: Any) -> None:
    from durably_py.storage.base import NewRun

    store.create("x0", header("x0"))
    with pytest.raises(ValidationError, match="x0 already exists"):
        store.create_bound([NewRun("x1", header("x1"), "id:x1"), NewRun("x0", header("x0"), "id:x0")])
    assert len(store.read("x0").records) == 1  # the run that existed is left as it was


def test_list_runs_newest_first_with_held_flags(store: Any) -> None:
    store.create("old", header("old", workflow="a"))
    time.sleep(0.02)
    store.create("new", header("new", workflow="b"))
    infos = store.list_runs()
    assert [i.run_id for i in infos] == ["new", "old"]
    assert all(isinstance(i, RunInfo) and not i.held for i in infos)
    assert infos[0].header["workflow"] == "b" and infos[0].last == infos[0].header
    time.sleep(0.02)
    lease = store.claim("old", "me", LONG)
    store.append(lease, line(t="step", i=9))
    infos = store.list_runs()
    assert [(i.run_id, i.held) for i in infos] == [("old", True), ("new", False)]
    assert infos[0].last == {"t": "step", "i": 9}
    assert infos[0].header["workflow"] == "a"
    assert infos[0].updated_at >= infos[1].updated_at > time.time() - 60
    store.release(lease)
    assert [i.held for i in store.list_runs()] == [False, False]


def test_run_info_reads_its_header_and_last_record_typed(store: Any) -> None:
    store.create("kid", header("kid", parent="mom", detached=True, input_digest="d1", identity="key:k"))
    store.create("plain", header("plain"))
    kid, plain = store.info("kid"), store.info("plain")
    assert (kid.kind, kid.ended, kid.end_status) == ("run", False, None)
    assert (kid.parent, kid.detached, kid.input_digest, kid.identity) == ("mom", True, "d1", "key:k")
    assert (plain.parent, plain.detached, plain.input_digest, plain.identity) == (None, False, None, None)
    lease = store.claim("kid", "me", LONG)
    store.append(lease, line(t="end", status="failed", error=None, ts=1.0))
    store.release(lease)
    ended = store.info("kid")
    assert (ended.kind, ended.ended, ended.end_status) == ("end", True, "failed")
    assert [i.run_id for i in store.list_runs() if i.ended] == ["kid"]


def test_sync_counts_fsyncs(store: Any) -> None:
    lease = started(store)
    before = store.fsyncs
    store.sync(lease)
    assert store.fsyncs > before
    after_first = store.fsyncs
    store.sync(lease)
    assert store.fsyncs == after_first
    store.append(lease, line(t="step"))
    assert store.fsyncs == after_first
    store.sync(lease)
    assert store.fsyncs == after_first + 1


def test_sync_all_makes_every_lease_durable_as_one_group(store: Any) -> None:
    leases = [started(store, run_id) for run_id in ("r1", "r2", "r3")]
    for lease in leases[:2]:
        store.append(lease, line(t="step"))
    before = store.fsyncs
    store.sync_all(leases)
    assert store.fsyncs > before
    after = store.fsyncs
    for lease in leases:
        store.sync(lease)  # nothing appended since the group commit: nothing left to sync
    store.sync_all(leases)
    store.sync_all([])
    assert store.fsyncs == after
    store.append(leases[0], line(t="step"))
    store.sync_all(leases)
    assert store.fsyncs > after
    other = started(store, "r4")
    store.release(other)
    with pytest.raises(LeaseLostError):
        store.sync_all([leases[1], other])
    for lease in leases:
        store.release(lease)


def test_claim_validates_owner_and_ttl(store: Any) -> None:
    store.create("r1", header("r1"))
    for owner, ttl in [("", LONG), (None, LONG), ("me", -1), ("me", "10"), ("me", float("nan"))]:
        with pytest.raises(ValidationError):
            store.claim("r1", owner, ttl)
    assert store.held("r1") is False


def test_concurrent_claims_have_one_winner(store: Any) -> None:
    store.create("r1", header("r1"))
    results: list[Lease | None] = []
    barrier = threading.Barrier(8)

    def claim(n: int) -> None:
        barrier.wait()
        results.append(store.claim("r1", f"t{n}", LONG))

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and winners[0].epoch == 1


def test_threads_append_through_one_lease(store: Any) -> None:
    lease = started(store)

    def work(n: int) -> None:
        for i in range(100):
            store.append(lease, line(t="step", n=n, i=i))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = store.read("r1").records
    assert len(records) == 2 + 400
    for n in range(4):
        assert [r["i"] for r in records if r.get("n") == n] == list(range(100))


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_time_based_leases_expire(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = storage_of(kind, tmp_path, request)
    store.create("r1", header("r1"))
    old = store.claim("r1", "me", 0.05)
    assert store.held("r1") is True
    assert store.heartbeat(old, 0.05) is True
    time.sleep(0.1)
    assert store.held("r1") is False
    store.append(old, line(t="step", late=True))
    new = store.claim("r1", "other", LONG)
    assert new is not None and new.epoch == 2
    with pytest.raises(LeaseLostError):
        store.append(old, line(t="step"))
    assert store.heartbeat(old, LONG) is False
    store.close()


def test_sqlite_is_shared_between_instances(tmp_path: Path) -> None:
    one, two = SqliteStorage(tmp_path / "db"), SqliteStorage(tmp_path / "db")
    lease = started(one)
    assert two.held("r1") and two.claim("r1", "x", LONG) is None
    one.append(lease, line(t="step"))
    assert kinds(two.read("r1").records) == ["run", "claim", "step"]
    one.close()
    two.close()


def sig(id: str, **fields: Any) -> bytes:
    """One signal line as `durably signal` sends it."""
    return msgspec.json.encode({"id": id, **fields}) + b"\n"


def ids(store: Any, run_id: str = "r1") -> list[str]:
    return [s["id"] for s in store.inbox(run_id)]


def test_signals_arrive_in_send_order_until_acked(store: Any) -> None:
    store.create("r1", header("r1"))
    store.create("r2", header("r2"))
    assert store.inbox("r1") == []
    store.send("r1", sig("a", name="approve", payload={"ok": True, "é": [1, None]}))
    store.send("r1", bytearray(sig("b", name="nudge")))
    store.send("r2", sig("other"))
    for i in range(20):
        store.send("r1", sig(f"n{i:02d}"))
    assert store.inbox("r1")[:2] == [
        {"id": "a", "name": "approve", "payload": {"ok": True, "é": [1, None]}},
        {"id": "b", "name": "nudge"},
    ]
    assert ids(store) == ["a", "b"] + [f"n{i:02d}" for i in range(20)]
    assert ids(store, "r2") == ["other"]
    store.ack("r1", "b")
    assert ids(store)[:3] == ["a", "n00", "n01"] and len(ids(store)) == 21
    store.ack("r1", "b")
    store.ack("r1", "never-sent")
    store.ack("r1", "other")
    assert len(ids(store)) == 21 and ids(store, "r2") == ["other"]
    for signal_id in ids(store):
        store.ack("r1", signal_id)
    assert store.inbox("r1") == [] and ids(store, "r2") == ["other"]
    assert kinds(store.read("r1").records) == ["run"]


def test_ack_removes_every_copy_of_a_resent_signal(store: Any) -> None:
    store.create("r1", header("r1"))
    store.send("r1", sig("x", n=1))
    store.send("r1", sig("y"))
    store.send("r1", sig("x", n=2))
    assert [(s["id"], s.get("n")) for s in store.inbox("r1")] == [("x", 1), ("y", None), ("x", 2)]
    store.ack("r1", "x")
    assert ids(store) == ["y"]


def test_signals_to_unknown_runs(store: Any) -> None:
    for call in (lambda: store.send("nope", sig("a")), lambda: store.inbox("nope"), lambda: store.ack("nope", "a")):
        with pytest.raises(RunNotFoundError):
            call()
    assert store.list_runs() == []


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_signal_calls_reject_invalid_run_ids(store: Any, bad: Any) -> None:
    for call in (lambda: store.send(bad, sig("a")), lambda: store.inbox(bad), lambda: store.ack(bad, "a")):
        with pytest.raises(ValidationError):
            call()


@pytest.mark.parametrize(
    "bad",
    [
        sig("a") + sig("b"),
        sig("a") + b"\n",
        b'{"id":"a"}',
        b"",
        b"\n",
        b"[1]\n",
        b'"a"\n',
        b"not json\n",
        b'{"name":"approve"}\n',
        b'{"id":""}\n',
        b'{"id":7}\n',
        b'{"id":null}\n',
        sig("a").decode(),
        None,
    ],
    ids=repr,
)
def test_send_rejects_anything_but_one_signal_line(store: Any, bad: Any) -> None:
    store.create("r1", header("r1"))
    with pytest.raises(ValidationError):
        store.send("r1", bad)
    assert store.inbox("r1") == []


@pytest.mark.parametrize("bad", ["", None, 7, b"a"], ids=repr)
def test_ack_rejects_invalid_signal_ids(store: Any, bad: Any) -> None:
    store.create("r1", header("r1"))
    store.send("r1", sig("a"))
    with pytest.raises(ValidationError):
        store.ack("r1", bad)
    assert ids(store) == ["a"]


def test_signals_need_no_lease_and_leave_it_alone(store: Any) -> None:
    lease = started(store)
    store.send("r1", sig("a"))
    store.append(lease, line(t="step"))
    store.send("r1", sig("b"))
    assert ids(store) == ["a", "b"]
    store.ack("r1", "a")
    store.append(lease, line(t="step"))
    store.sync(lease)
    assert store.heartbeat(lease, LONG) is True
    assert kinds(store.read("r1").records) == ["run", "claim", "step", "step"]
    store.release(lease)
    store.send("r1", sig("c"))
    assert ids(store) == ["b", "c"]


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_signals_are_shared_between_instances(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    owner, sender = storage_of(kind, tmp_path, request), storage_of(kind, tmp_path, request)
    lease = started(owner)
    sender.send("r1", sig("a", payload=1))
    assert owner.inbox("r1") == [{"id": "a", "payload": 1}]
    sender.send("r1", sig("b"))
    owner.ack("r1", "b")
    owner.ack("r1", "a")
    assert owner.inbox("r1") == [] and sender.inbox("r1") == []
    sender.send("r1", sig("c"))
    assert ids(owner) == ["c"]
    sender.ack("r1", "c")
    assert owner.inbox("r1") == []
    owner.append(lease, line(t="step"))
    assert kinds(sender.read("r1").records) == ["run", "claim", "step"]
    owner.close()
    sender.close()


def test_sqlite_upgrades_an_older_database_to_hold_signals(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    first = SqliteStorage(path)
    first.create("r1", header("r1"))
    first.close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE signals")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    store = SqliteStorage(path)
    store.send("r1", sig("a"))
    assert ids(store) == ["a"] and kinds(store.read("r1").records) == ["run"]
    store.close()


def test_partials_append_read_from_any_offset_and_drop(store: Any) -> None:
    started(store, "r1")
    assert store.read_partials("r1", "0") == [] and store.partial_paths("r1") == {}
    store.append_partials("r1", "0", 1, [b'"a"', b'"b"'])
    store.append_partials("r1", "0", 2, [b'{"c":1}'])
    store.append_partials("r1", "2.1", 1, [b"3"])
    store.append_partials("r1", "0", 2, [])
    assert store.read_partials("r1", "0") == [b'"a"', b'"b"', b'{"c":1}']
    assert store.read_partials("r1", "0", 2) == [b'{"c":1}'] and store.read_partials("r1", "0", 9) == []
    assert store.partial_paths("r1") == {"0": 3, "2.1": 1}
    assert [r["t"] for r in store.read("r1").records] == ["run", "claim"]  # beside the log, never in it
    store.drop_partials("r1", "0")
    assert store.read_partials("r1", "0") == [] and store.partial_paths("r1") == {"2.1": 1}
    store.drop_partials("r1")
    assert store.partial_paths("r1") == {}


def test_partials_go_with_their_run_and_refuse_bad_input(store: Any) -> None:
    lease = started(store, "r1")
    store.append_partials("r1", "1", 1, [b'"x"'])
    for call in (lambda: store.append_partials("r1", "1/../x", 1, [b'"x"']),
                 lambda: store.append_partials("r1", "1", 0, [b'"x"']),
                 lambda: store.append_partials("r1", "1", 1, [b'"x"\n"y"']),
                 lambda: store.append_partials("r1", "1", 1, ["x"]),
                 lambda: store.append_partials("../r", "1", 1, [b'"x"']),
                 lambda: store.read_partials("r1", "1", -1),
                 lambda: store.drop_partials("r1", "")):
        with pytest.raises(ValidationError):
            call()
    assert store.read_partials("r1", "1") == [b'"x"']
    store.release(lease)
    assert store.delete("r1")
    assert store.read_partials("r1", "1") == [] and store.partial_paths("r1") == {}


# -- file adapter ---------------------------------------------------------------------------------------------


def log_path(fs: FileStorage, run_id: str = "r1") -> Path:
    return fs.dir / "runs" / f"{run_id}.jsonl"


def test_file_layout(fs: FileStorage) -> None:
    assert not fs.dir.exists()
    lease = started(fs, owner="worker-1")
    fs.bind("a/../../b", "r1")
    runs = sorted(p.name for p in (fs.dir / "runs").iterdir())
    assert runs == ["r1.jsonl", "r1.lock"]
    (index,) = sorted((fs.dir / "index").iterdir())  # a first binding is a hard link: no lock file
    assert len(index.name) == 64 and index.read_text() == "r1"
    assert fs.bind("a/../../b", "r2", expect="r1") is True  # a rebinding is decided under the binding's lock
    index, lock = sorted((fs.dir / "index").iterdir())
    assert index.read_text() == "r2" and lock.name == index.name + ".lock"
    assert fs.bind("a/../../b", "r1", expect="r1") is False and fs.bind("a/../../b", "r3") is False
    fs.bind("a/../../b", "r1", expect="r2")
    info = fs.holder_info("r1")
    assert info is not None and info["owner"] == "worker-1" and info["pid"] == os.getpid() and info["epoch"] == 1
    fs.release(lease)


def test_claim_reads_the_epoch_an_older_owner_sidecar_kept(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    (fs.dir / "runs" / "r1.owner").write_text('{"owner": "old", "epoch": 5, "pid": 1, "host": "h", "at": "x"}')
    assert fs.holder_info("r1")["epoch"] == 5  # a state dir from before lock files held the claimant
    lease = fs.claim("r1", "new", LONG)
    assert lease is not None and lease.epoch == 6
    assert fs.holder_info("r1")["owner"] == "new" and fs.info("r1").epoch == 6
    fs.release(lease)
    again = fs.claim("r1", "newer", LONG)
    assert again is not None and again.epoch == 7 and fs.holder_info("r1")["epoch"] == 7
    fs.release(again)


def test_same_process_second_storage_sees_the_lease(fs: FileStorage) -> None:
    lease = started(fs)
    other = FileStorage(fs.dir)
    assert other.held("r1") is True
    assert other.claim("r1", "other", LONG) is None
    fs.release(lease)
    assert other.held("r1") is False
    again = other.claim("r1", "other", LONG)
    assert again is not None and again.epoch == 2
    assert fs.held("r1") is True
    other.release(again)


def test_torn_last_line_is_dropped_then_cut_by_claim(fs: FileStorage) -> None:
    lease = started(fs)
    fs.append(lease, line(t="step", i=1) + line(t="step", i=2))
    fs.release(lease)
    path = log_path(fs)
    with open(path, "ab") as f:
        f.write(b'{"t":"step","i":3,"v":"hal')
    before = path.read_bytes()
    log = fs.read("r1")
    assert [r.get("i") for r in log.records] == [None, None, 1, 2]
    assert log.torn == f"dropped a torn last line (26 bytes) at line 5 of {path}"
    assert path.read_bytes() == before
    assert [i.last for i in fs.list_runs()] == [{"t": "step", "i": 2}]
    lease = fs.claim("r1", "me", LONG)
    assert lease is not None and lease.epoch == 2
    fs.append(lease, line(t="step", i=3))
    log = fs.read("r1")
    assert log.torn is None
    assert kinds(log.records) == ["run", "claim", "step", "step", "claim", "step"]
    assert path.read_bytes().startswith(before[: before.rindex(b"\n") + 1])
    fs.release(lease)


def test_amend_cuts_a_torn_tail_before_its_line_and_leaves_the_lock_free(fs: FileStorage) -> None:
    lease = started(fs)
    fs.release(lease)
    path = log_path(fs)
    with open(path, "ab") as f:
        f.write(b'{"t":"step","i":3,"v":"hal')
    assert fs.amend("r1", lambda records, where: line(t="pause")) is True
    log = fs.read("r1")
    assert log.torn is None and kinds(log.records) == ["run", "claim", "pause"]
    assert fs.holder_info("r1")["epoch"] == 1  # the owner sidecar still names the last real claim
    other = FileStorage(fs.dir)
    again = other.claim("r1", "other", LONG)
    assert again is not None and again.epoch == 2
    other.release(again)


@pytest.mark.parametrize("tail", [b'{"t":"st\n', b"[1,2]\n", b"\x00\x00\x00\x00\n", b'"just a string"'])
def test_damaged_complete_last_line_is_torn_too(fs: FileStorage, tail: bytes) -> None:
    fs.create("r1", header("r1"))
    with open(log_path(fs), "ab") as f:
        f.write(tail)
    log = fs.read("r1")
    assert kinds(log.records) == ["run"]
    assert log.torn is not None and f"({len(tail)} bytes) at line 2 of" in log.torn
    lease = fs.claim("r1", "me", LONG)
    assert log_path(fs).read_bytes() == header("r1") + line(t="claim", epoch=1, owner="me", at=lease_at(fs))
    fs.release(lease)


def lease_at(fs: FileStorage) -> str:
    return fs.read("r1").records[-1]["at"]


@pytest.mark.parametrize("bad", [b'{"t":"step",\n', b"[1]\n", b"42\n", b"\x00\x00\n"], ids=repr)
def test_mid_file_corruption_is_reported_and_never_touched(fs: FileStorage, bad: bytes) -> None:
    lease = started(fs)
    fs.release(lease)
    path = log_path(fs)
    with open(path, "ab") as f:
        f.write(bad + line(t="step", i=1) + b'{"t":"torn')
    before = path.read_bytes()
    with pytest.raises(CorruptLogError) as caught:
        fs.read("r1")
    assert f"line 3 of {path}" in str(caught.value)
    assert caught.value.line == 3 and caught.value.path == str(path)
    with pytest.raises(CorruptLogError, match="line 3 of"):
        fs.claim("r1", "me", LONG)
    assert path.read_bytes() == before
    assert fs.held("r1") is False
    assert [i.run_id for i in fs.list_runs()] == ["r1"]


def test_empty_log_cannot_be_claimed(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    log_path(fs).write_bytes(b'{"t":"ru')
    assert fs.read("r1").records == []
    with pytest.raises(CorruptLogError, match="no header"):
        fs.claim("r1", "me", LONG)
    assert log_path(fs).read_bytes() == b'{"t":"ru'


def test_foreign_write_fences_the_lease(fs: FileStorage) -> None:
    lease = started(fs)
    fs.append(lease, line(t="step"))
    with open(log_path(fs), "ab") as f:
        f.write(line(t="intruder"))
    with pytest.raises(LeaseLostError, match="changed by someone else"):
        fs.append(lease, line(t="step"))
    assert fs.heartbeat(lease, LONG) is False
    fs.release(lease)


def replace_log(fs: FileStorage) -> bytes:
    """Replace r1's log file with a copy of itself (a foreign tool's save); the copy's bytes."""
    path = log_path(fs)
    tmp = path.with_suffix(".other")
    data = path.read_bytes()
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


@pytest.mark.parametrize("after", [0, 5])
def test_foreign_replace_fails_the_lease_before_a_sync(fs: FileStorage, after: int) -> None:
    """A log replaced under a live lease: an append the size check lets through goes nowhere durable, since the
    next sync fails the lease; the replacement is left as it was."""
    lease = started(fs)
    for _ in range(after):
        fs.append(lease, line(t="step"))
    copy = replace_log(fs)
    fs.append(lease, line(t="unseen"))  # same size as the copy: only the look at the link count tells
    with pytest.raises(LeaseLostError, match="changed by someone else"):
        fs.sync(lease)
    assert fs.heartbeat(lease, LONG) is False
    assert log_path(fs).read_bytes() == copy
    fs.release(lease)


def test_foreign_replace_stops_appends_within_a_look(fs: FileStorage) -> None:
    lease = started(fs)
    replace_log(fs)
    accepted = 0
    with pytest.raises(LeaseLostError, match="changed by someone else"):
        for _ in range(LOOK_EVERY + 1):
            fs.append(lease, line(t="step"))
            accepted += 1
    assert accepted <= LOOK_EVERY
    fs.release(lease)


def test_rewrite_leaves_no_temp_file_and_keeps_the_epoch(fs: FileStorage) -> None:
    lease = started(fs)
    fs.append(lease, line(t="step") * 10)
    fs.rewrite(lease, header("r1"))
    fs.append(lease, line(t="after"))
    assert sorted(p.name for p in (fs.dir / "runs").iterdir()) == ["r1.jsonl", "r1.lock"]
    assert kinds(fs.read("r1").records) == ["run", "after"]
    fs.release(lease)
    assert fs.claim("r1", "me", LONG).epoch == 2


def test_list_runs_reads_the_tail_of_big_logs(fs: FileStorage) -> None:
    lease = started(fs)
    fs.append(lease, b"".join(line(t="step", i=i, pad="p" * 100) for i in range(2000)))
    fs.append(lease, line(t="done", big="x" * 20_000))
    (info,) = fs.list_runs()
    assert info.last["t"] == "done" and info.header["run_id"] == "r1" and info.held
    fs.release(lease)


def test_list_runs_ignores_strangers(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    (fs.dir / "runs" / "notes.txt").write_text("hi")
    (fs.dir / "runs" / "..jsonl").write_text("{}\n")
    assert [i.run_id for i in fs.list_runs()] == ["r1"]
    assert FileStorage(fs.dir / "nowhere").list_runs() == []


def test_read_returns_every_record_of_a_long_log(fs: FileStorage) -> None:
    # How fast this is lives in bench/steps.py ("replay"); here only that nothing is lost.
    lease = started(fs)
    fs.append(lease, b"".join(line(t="step", i=i, name="fetch", ok=True, v=[1, 2, 3]) for i in range(10_000)))
    records = fs.read("r1").records
    assert len(records) == 10_002 and [r["i"] for r in records[2:]] == list(range(10_000))
    fs.release(lease)


CHILD = """
import sys, time
from durably_py.storage import FileStorage
lease = FileStorage(sys.argv[1]).claim("r1", "child", 3600)
print("claimed" if lease else "refused", lease and lease.epoch, flush=True)
time.sleep(60)
"""


def test_cross_process_lease_dies_with_its_process(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(fs.dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["claimed", "1"]
        assert fs.held("r1") is True
        assert fs.claim("r1", "parent", LONG) is None
        assert [i.held for i in fs.list_runs()] == [True]
        assert fs.holder_info("r1")["pid"] == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert fs.held("r1") is False
    lease = fs.claim("r1", "parent", LONG)
    assert lease is not None and lease.epoch == 2
    assert [(r["owner"], r["epoch"]) for r in fs.read("r1").records[1:]] == [("child", 1), ("parent", 2)]
    fs.release(lease)


def inbox_dir(fs: FileStorage, run_id: str = "r1") -> Path:
    return fs.dir / "runs" / f"{run_id}.inbox"


def test_file_inbox_layout(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    assert fs.inbox("r1") == [] and not inbox_dir(fs).exists()
    before = fs.fsyncs
    fs.send("r1", sig("a"))
    fs.send("r1", sig("b"))
    assert fs.fsyncs > before
    names = sorted(p.name for p in inbox_dir(fs).iterdir())
    assert len(names) == 2 and all(len(n) == 20 + 1 + 16 + 5 and n.endswith(".json") for n in names)
    assert [(inbox_dir(fs) / n).read_bytes() for n in names] == [sig("a"), sig("b")]
    assert sorted(p.name for p in (fs.dir / "runs").iterdir()) == ["r1.inbox", "r1.jsonl"]
    assert [i.run_id for i in fs.list_runs()] == ["r1"]
    fs.ack("r1", "a")
    assert [p.name for p in inbox_dir(fs).iterdir()] == names[1:]


def test_file_inbox_skips_garbage_and_sends_in_flight(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    fs.send("r1", sig("real"))
    box = inbox_dir(fs)
    (box / "00000000000000000001-aa.json").write_bytes(b"not json\n")
    (box / "00000000000000000002-bb.json").write_bytes(b"[1]\n")
    (box / "00000000000000000003-cc.json").write_bytes(b'{"name":"no id"}\n')
    (box / "00000000000000000004-dd.json").write_bytes(b"")
    (box / "00000000000000000005-ee.json").mkdir()
    (box / ".signal.1.ff.tmp").write_bytes(sig("half-sent"))
    (box / "notes.txt").write_bytes(sig("stranger"))
    assert fs.inbox("r1") == [{"id": "real"}]
    fs.ack("r1", "half-sent")
    fs.ack("r1", "real")
    assert fs.inbox("r1") == [] and FileStorage(fs.dir).inbox("r1") == []
    assert len(list(box.iterdir())) == 7


SENDER = """
import sys
from durably_py.storage import FileStorage
FileStorage(sys.argv[1]).send("r1", b'{"id": "from-child", "pid": 1}\\n')
"""


def test_another_process_sends_while_the_lease_is_held(fs: FileStorage) -> None:
    lease = started(fs)
    fs.send("r1", sig("mine"))
    done = subprocess.run([sys.executable, "-c", SENDER, str(fs.dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert fs.held("r1") is True
    assert fs.inbox("r1") == [{"id": "mine"}, {"id": "from-child", "pid": 1}]
    fs.ack("r1", "from-child")
    assert ids(fs) == ["mine"]
    fs.append(lease, line(t="step"))
    assert kinds(fs.read("r1").records) == ["run", "claim", "step"]
    fs.release(lease)


# ---- the queue: every adapter answers "the next due runs" from its index ---------------------------------

def test_create_queues_the_run_due_now_and_due_orders_by_priority_then_time(store) -> None:
    now = time.time()
    store.create("low", header("low"), priority=-1)
    store.create("old", header("old"), at=now - 10)
    store.create("new", header("new"))
    store.create("high", header("high"), priority=5)
    store.create("later", header("later"), at=now + 3600, priority=9)
    assert store.due(10) == ["high", "old", "new", "low"]
    assert store.due(2) == ["high", "old"]
    assert store.due(10, skip=("high", "new")) == ["old", "low"]
    assert store.due(10, now + 7200)[0] == "later"
    entry = store.entry("later")
    assert entry.run_id == "later" and entry.priority == 9 and entry.at == pytest.approx(now + 3600, abs=1)
    assert store.entry("nope") is None


def test_held_runs_are_not_due_until_released_and_ended_runs_leave_the_queue(store) -> None:
    lease = started(store, "a")
    store.create("b", header("b"))
    assert store.due(10) == ["b"]
    store.release(lease)
    assert sorted(store.due(10)) == ["a", "b"]
    store.unschedule("a")
    store.unschedule("a")
    assert store.due(10) == ["b"] and store.entry("a") is None


def test_schedule_parks_a_run_and_a_matching_signal_wakes_it(store) -> None:
    store.create("w", header("w"))
    store.schedule("w", None, wait=("approval",))
    assert store.due(10) == [] and store.entry("w").wait == ("approval",)
    store.send("w", line(id="s1", name="other"))
    assert store.due(10) == []
    store.send("w", line(id="s2", name="approval"))
    assert store.due(10) == ["w"]
    store.schedule("w", time.time() + 3600, priority=3)
    assert store.due(10) == [] and store.entry("w").priority == 3
    assert store.wake("w") is True and store.due(10) == ["w"]
    assert store.wake("w") is False
    with pytest.raises(RunNotFoundError):
        store.schedule("ghost", None)
    assert store.wake("ghost") is False


def test_claim_due_claims_in_order_and_never_twice(store) -> None:
    for i in range(5):
        store.create(f"r{i}", header(f"r{i}"), priority=i)
    first = store.claim_due("w1", LONG, 2)
    assert [lease.run_id for lease in first] == ["r4", "r3"]
    assert first[0].records[-1]["t"] == "claim" and first[0].epoch == 1
    second = store.claim_due("w2", LONG, 10, skip=("r0",))
    assert [lease.run_id for lease in second] == ["r2", "r1"]
    assert store.claim_due("w3", LONG, 0) == []
    assert [lease.run_id for lease in store.claim_due("w3", LONG, 10)] == ["r0"]
    assert store.due(10) == []


def test_claim_due_from_two_adapters_at_once_shares_no_run(store, tmp_path, request) -> None:
    if isinstance(store, MemoryStorage):
        other = store
    else:
        kind = "file" if isinstance(store, FileStorage) else "sqlite" if isinstance(store, SqliteStorage) else "postgres"
        other = storage_of(kind, tmp_path, request)
    for i in range(40):
        store.create(f"r{i}", header(f"r{i}"))
    got: list[list[str]] = [[], []]

    def take(adapter: Any, slot: int) -> None:
        while True:
            leases = adapter.claim_due(f"w{slot}", LONG, 3)
            if not leases:
                return
            got[slot].extend(lease.run_id for lease in leases)

    threads = [threading.Thread(target=take, args=(a, i)) for i, a in enumerate((store, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got[0] + got[1]) == sorted(f"r{i}" for i in range(40))
    assert not set(got[0]) & set(got[1])


def test_a_run_parked_in_a_join_is_due_once_its_last_child_leaves_the_queue(store) -> None:
    store.create("p", header("p"))
    for i in range(3):
        store.create(f"c{i}", header(f"c{i}", parent="p"))
    store.unschedule("c2")  # it ended before the parent parked: nothing to wait for
    assert store.join_wait("p", ("c0", "c1", "c2")) is False
    assert store.entry("p").at is None and store.due(10) == ["c0", "c1"]
    store.unschedule("c0")
    assert store.entry("p").at is None
    store.unschedule("c0")  # ending twice (a crash redone) changes nothing
    assert store.entry("p").at is None
    store.unschedule("c1")
    assert store.entry("p").at <= time.time() and store.due(10) == ["p"]
    assert store.join_wait("p", ("c0", "c1")) is True  # every child ended: due at once
    assert store.due(10) == ["p"]
    with pytest.raises(RunNotFoundError):
        store.join_wait("nope", ())


def test_a_join_wait_is_dropped_when_the_run_parks_on_something_else_or_ends(store) -> None:
    store.create("p", header("p"))
    store.create("c", header("c", parent="p"))
    store.create("d", header("d", parent="p"))
    assert store.join_wait("p", ("c",)) is False
    store.schedule("p", time.time() + 3600)  # resumed, then parked on a sleep
    store.unschedule("c")
    assert store.entry("p").at > time.time() + 3000
    assert store.join_wait("p", ("d",)) is False
    store.unschedule("p")  # the parent ended (cancelled): its child's end wakes nothing
    store.unschedule("d")
    assert store.entry("p") is None and store.due(10) == []


def test_children_ending_at_once_on_two_adapters_wake_their_parent_once_the_last_ended(store, tmp_path,
                                                                                       request) -> None:
    if isinstance(store, MemoryStorage):
        other = store
    else:
        kind = "file" if isinstance(store, FileStorage) else "sqlite" if isinstance(store, SqliteStorage) else "postgres"
        other = storage_of(kind, tmp_path, request)
    for round in range(3):
        parent = f"p{round}"
        store.create(parent, header(parent))
        children = [f"{parent}c{i}" for i in range(16)]
        for child in children:
            store.create(child, header(child, parent=parent))
        parked = threading.Event()

        def end(adapter: Any, mine: list[str], parked: threading.Event = parked) -> None:
            if adapter is other:
                parked.wait()
            for child in mine:
                adapter.unschedule(child)

        # half the children end while the parent parks on the other adapter, half after
        threads = [threading.Thread(target=end, args=(store, children[:8])),
                   threading.Thread(target=end, args=(other, children[8:]))]
        for t in threads:
            t.start()
        other.join_wait(parent, tuple(children))
        parked.set()
        for t in threads:
            t.join()
        assert store.due(10) == [parent], round
        store.unschedule(parent)


def test_a_state_dir_from_before_the_queue_queues_its_unended_runs(tmp_path: Path) -> None:
    import shutil

    old = FileStorage(tmp_path / "state")
    for run_id in ("open", "done"):
        old.create(run_id, header(run_id))
    lease = old.claim("done", "me", LONG)
    old.append(lease, line(t="end", status="completed", result=1, error=None, ts=1.0))
    old.release(lease)
    shutil.rmtree(tmp_path / "state" / "queue")
    upgraded = FileStorage(tmp_path / "state")
    assert upgraded.due(10) == ["open"]
    assert upgraded.entry("done") is None


def test_a_sqlite_database_from_before_the_queue_queues_its_unended_runs(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    old = SqliteStorage(path)
    for run_id in ("open", "done"):
        old.create(run_id, header(run_id))
    lease = old.claim("done", "me", LONG)
    old.append(lease, line(t="end", status="completed", result=1, error=None, ts=1.0))
    old.release(lease)
    old.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE queue")
        db.execute("PRAGMA user_version=2")
    upgraded = SqliteStorage(path)
    assert upgraded.due(10) == ["open"]
    assert upgraded.entry("done") is None
    upgraded.close()


# -- an ended run is never claimed again; names every adapter can store; due runs by workflow; workers -------


def ended_run(store: Any, run_id: str, **extra: Any) -> None:
    """A run whose log ends in an end record, still queued (its process died before leaving the queue)."""
    lease = started(store, run_id) if not extra else None
    if lease is None:
        store.create(run_id, header(run_id, **extra))
        lease = store.claim(run_id, "me", LONG)
    store.append(lease, line(t="end", status="completed", result=1, error=None, ts=1.0))
    store.sync(lease)
    store.release(lease)


def test_an_ended_run_is_refused_atomically_and_leaves_the_queue(store: Any) -> None:
    store.create("p", header("p"))
    ended_run(store, "c", parent="p")
    assert store.join_wait("p", ("c",)) is False  # the parent waits for its child, still queued
    before = store.read("c").records
    assert "c" in store.due(10)
    assert store.claim("c", "late", LONG) is None  # nothing written, and the run left the queue
    assert store.read("c").records == before and store.info("c").epoch == 1
    assert store.entry("c") is None and store.due(10) == ["p"]  # as its unschedule would have: the parent is due
    assert store.claim_due("w", LONG, 10)[0].run_id == "p"
    lease = store.claim("c", "retry", LONG, reopen=True)  # a retry reopening it claims it
    assert lease is not None and lease.epoch == 2 and kinds(store.read("c").records)[-2:] == ["end", "claim"]


def test_claim_due_never_claims_a_run_that_ended_after_due_listed_it(store: Any) -> None:
    for i in range(6):
        store.create(f"r{i}", header(f"r{i}"))
    listed = store.due(10)
    for run_id in listed[:3]:  # another worker ran these to their end between the listing and the claim
        lease = store.claim(run_id, "other", LONG)
        store.append(lease, line(t="end", status="completed", result=1, error=None, ts=1.0))
        store.release(lease)
    claimed = store.claim_due("w", LONG, 10)
    assert sorted(lease.run_id for lease in claimed) == ["r3", "r4", "r5"]
    for run_id in listed[:3]:
        assert kinds(store.read(run_id).records)[-1] == "end" and store.entry(run_id) is None


@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", "x\udfff"], ids=repr)
def test_names_no_adapter_can_store_are_refused_before_anything_is_written(store: Any, bad: str) -> None:
    store.create("r", header("r"))
    with pytest.raises(ValidationError):
        store.send("r", json.dumps({"id": "s1", "name": bad}).encode() + b"\n")  # escaped as JSON writes it
    with pytest.raises(ValidationError):
        store.schedule("r", None, wait=(bad,))
    assert store.inbox("r") == [] and store.entry("r").wait == ()


def test_due_and_claim_due_keep_the_workflows_asked_for(store: Any) -> None:
    store.create("a1", header("a1", workflow="a"), priority=1)
    store.create("b1", header("b1", workflow="b"), priority=2)
    store.create("a2", header("a2", workflow="a"))
    assert store.due(10) == ["b1", "a1", "a2"]
    assert store.due(10, workflows=frozenset({"a"})) == ["a1", "a2"]
    assert store.due(10, workflows=frozenset()) == []
    assert [lease.run_id for lease in store.claim_due("w", LONG, 1, workflows=frozenset({"a", "c"}))] == ["a1"]
    assert store.due(10) == ["b1", "a2"]
    with pytest.raises(ValidationError):
        store.due(10, workflows="a")


def test_workers_advertise_what_they_serve_until_they_retire_or_lapse(store: Any) -> None:
    assert store.workers() == []
    store.advertise("host:1:aa", {"serves": ["a"], "pid": 1}, 2.0)
    store.advertise("host:2:bb", {"serves": None}, 2.0)
    store.advertise("host:1:aa", {"serves": ["a", "b"], "pid": 1}, 2.0)  # renewed, and changed
    found = {w["owner"]: w for w in store.workers()}
    assert found.keys() == {"host:1:aa", "host:2:bb"} and found["host:1:aa"]["serves"] == ["a", "b"]
    store.retire("host:2:bb")
    store.retire("host:2:bb")
    assert [w["owner"] for w in store.workers()] == ["host:1:aa"]
    with pytest.raises(ValidationError):
        store.advertise("", {}, 1.0)
    with pytest.raises(ValidationError):
        store.advertise("x", {"v": object()}, 1.0)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_an_advertisement_lapses_with_its_ttl(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = storage_of(kind, tmp_path, request)
    store.advertise("w", {"serves": []}, 0.2)
    assert len(store.workers()) == 1
    time.sleep(0.4)
    assert store.workers() == []


def test_a_file_advertisement_lives_as_long_as_its_process(tmp_path: Path) -> None:
    code = ("import sys, time; from durably_py import FileStorage\n"
            "FileStorage(sys.argv[1]).advertise('other:9:cc', {'serves': ['x']}, 1.0)\n"
            "print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "state")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        mine = FileStorage(tmp_path / "state")
        assert [w["owner"] for w in mine.workers()] == ["other:9:cc"]
        proc.kill()
        proc.wait()
        assert mine.workers() == []
        mine.advertise("me:1:dd", {"serves": []}, 1.0)  # and the dead worker's files are cleaned up
        assert sorted(os.listdir(tmp_path / "state" / "workers")) == sorted(
            os.path.basename(p) for p in mine._worker_paths("me:1:dd"))
        mine.close()
        assert FileStorage(tmp_path / "state").workers() == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_wait_or_signal_name_no_adapter_can_store_fails_before_anything_is_recorded(store: Any) -> None:
    import asyncio

    from durably_py import Engine, workflow

    @workflow(name="nul_waiter")
    async def nul_waiter(ctx: Any) -> Any:
        await ctx.step(lambda: 1, name="before")
        return await ctx.wait_for("ap\x00proval")

    engine = Engine(store)
    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.run(nul_waiter, wait=False))
    assert info.value.hint
    [run] = store.list_runs()
    assert "wait" not in kinds(store.read(run.run_id).records)
    for bad in ("ap\x00proval", "\ud800"):
        with pytest.raises(ValidationError):
            asyncio.run(engine.signal(run.run_id, bad))
    assert store.inbox(run.run_id) == []


# ---- group commits, next due time, batched creation with due times ---------------------------------------------

def test_finish_all_ends_several_runs_in_one_group_commit(store) -> None:
    """Each lease's appends durable, each run out of the queue and released, in one commit; a lost lease is
    reported for its run alone, whose entry stays; a parent waiting in a join is made due by its last child."""
    store.create("p", header("p"))
    leases = []
    for name in ("c0", "c1", "solo"):
        store.create(name, header(name, parent="p" if name != "solo" else None))
    assert store.join_wait("p", ("c0", "c1")) is False
    for name in ("c0", "c1", "solo"):
        lease = store.claim(name, "me", LONG)
        store.append(lease, line(t="end", status="completed", result=1, error=None, ts=1.0))
        leases.append(lease)
    stale = store.claim("p", "me", LONG)
    store.release(stale)
    fsyncs = store.fsyncs
    errors = store.finish_all([*leases, stale])
    assert errors[:3] == [None, None, None] and isinstance(errors[3], LeaseLostError)
    if not isinstance(store, MemoryStorage):  # memory counts a would-be fsync per lease
        assert store.fsyncs - fsyncs == 1, "one group commit (a syncfs, one WAL fsync, one durable commit)"
    for name in ("c0", "c1", "solo"):
        assert store.entry(name) is None and not store.held(name)
        assert kinds(store.read(name).records)[-1] == "end"
    assert store.entry("p") is not None and store.entry("p").at <= time.time()
    assert store.due(10) == ["p"]


def test_next_due_is_the_earliest_later_due_time(store) -> None:
    now = time.time()
    assert store.next_due() is None
    store.create("now", header("now"))
    assert store.next_due() is None  # due already: nothing falls due later
    store.create("soon", header("soon"), at=now + 60)
    store.create("later", header("later"), at=now + 600)
    store.create("parked", header("parked"))
    store.schedule("parked", None)
    assert store.next_due() == pytest.approx(now + 60, abs=0.01)
    assert store.next_due(now + 120) == pytest.approx(now + 600, abs=0.01)


def test_create_bound_queues_each_run_at_its_due_time_and_priority(store) -> None:
    from durably_py.storage.base import NewRun

    now = time.time()
    runs = [NewRun("a", header("a"), "id:a", at=now + 60), NewRun("b", header("b"), "id:b", priority=5),
            NewRun("c", header("c"), "id:c")]
    assert store.create_bound(runs) is None
    assert store.entry("a").at == pytest.approx(now + 60, abs=0.01) and store.entry("b").priority == 5
    assert store.due(10) == ["b", "c"]
    with pytest.raises(ValidationError):
        store.create_bound([NewRun("d", header("d"), "id:d", priority=True)])
    assert store.lookup("id:d") is None


def test_watch_tells_another_process_of_new_due_work(store, tmp_path: Path) -> None:
    """A second adapter on the same store (another process would do the same) is told within moments that a
    run was created, woken or queued again; memory has no other process to tell."""
    if isinstance(store, MemoryStorage):
        assert store.watch(lambda: None) is None
        return
    told = threading.Event()
    stop = store.watch(told.set)
    assert stop is not None
    try:
        other = _twin(store)
        for act in (lambda: other.create("w1", header("w1")), lambda: other.schedule("w1", None),
                    lambda: other.wake("w1")):
            told.clear()
            started_at = time.monotonic()
            act()
            assert told.wait(5), "no wake-up"
            print(f"wake-up after {(time.monotonic() - started_at) * 1000:.2f} ms")
        other.close()
    finally:
        stop()


def _twin(store: Any) -> Any:
    """Another adapter on the same store, as another process would open it."""
    if isinstance(store, FileStorage):
        return FileStorage(store.dir)
    if isinstance(store, SqliteStorage):
        return SqliteStorage(store.path)
    return type(store)(store.dsn, schema=store.schema)
