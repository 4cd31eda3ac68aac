"""The file queue's due journal (`queue/.due.jsonl`): finding due runs reads only what changed since the last
look, a state directory from before the journal is upgraded in place, a journal that is missing, from another
boot, or behind its entry files is rebuilt or corrected, and processes SIGKILLed at any point while they
enqueue, claim, park, wake and end runs lose no queued run from any process's view."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from durably_py.storage import LOG_VERSION, FileStorage
from durably_py.storage.filedue import JOURNAL


def header(run_id: str) -> bytes:
    record = {"t": "run", "v": LOG_VERSION, "run_id": run_id, "workflow": "wf", "key": None, "created_at": "2024"}
    return msgspec.json.encode(record) + b"\n"


def journal_of(store: FileStorage) -> Path:
    return store.queue_dir / JOURNAL


def truly_due(store: FileStorage, now: float) -> set[str]:
    """The runs the entry files say are due (their logs exist): what every view must agree with."""
    out = set()
    for name in os.listdir(store.queue_dir):
        if name.endswith(".json") and not name.startswith("."):
            entry = store.entry(name[:-5])
            if entry is not None and entry.at is not None and entry.at <= now and \
                    (store.runs_dir / f"{entry.run_id}.jsonl").exists():
                out.add(entry.run_id)
    return out


def test_looks_read_only_new_lines_and_see_other_processes_changes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    a, b = FileStorage(state), FileStorage(state)
    now = time.time()
    for i in range(50):
        a.create(f"r{i:03}", header(f"r{i:03}"), at=now - 100 + i)
    assert b.due(3) == ["r000", "r001", "r002"]
    size = journal_of(a).stat().st_size
    assert b.due(3) == ["r000", "r001", "r002"]  # nothing new: nothing read, nothing written
    assert journal_of(a).stat().st_size == size
    a.schedule("r000", now + 3600)
    a.create("urgent", header("urgent"), priority=5)
    assert b.due(3) == ["urgent", "r001", "r002"]
    assert b.next_due() == pytest.approx(now + 3600)
    leases = a.claim_due("w", 30, 2)
    assert [lease.run_id for lease in leases] == ["urgent", "r001"]
    a.finish_all(leases)
    assert b.due(2) == ["r002", "r003"]
    a.close()
    b.close()


def test_a_state_dir_from_before_the_journal_and_a_lost_or_foreign_journal_are_rebuilt_from_the_entries(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = FileStorage(state)
    now = time.time()
    for i in range(5):
        store.create(f"r{i}", header(f"r{i}"), at=now - 10 + i)
    assert store.due(1) == ["r0"]
    store.close()
    journal_of(store).unlink()  # as a state dir written before the journal existed
    old = FileStorage(state)
    assert old.due(10) == [f"r{i}" for i in range(5)]
    assert journal_of(old).exists()  # upgraded in place
    old.close()
    # a journal written before the machine last booted is never trusted: its lines may have been lost
    path = journal_of(old)
    path.write_bytes(b'{"v":1,"boot":"another-boot"}\n')
    fresh = FileStorage(state)
    assert fresh.due(10) == [f"r{i}" for i in range(5)]
    assert b"another-boot" not in path.read_bytes()
    fresh.close()


def test_a_view_behind_or_ahead_of_the_files_is_corrected_by_them(tmp_path: Path) -> None:
    """What a process killed between a journal line and its entry file leaves: a line without its file (the
    view is ahead: it is checked and dropped) and a file changed to later without its line."""
    state = tmp_path / "state"
    store = FileStorage(state)
    now = time.time()
    store.create("kept", header("kept"), at=now - 5)
    store.create("later", header("later"), at=now - 4)
    assert store.due(10) == ["kept", "later"]
    with open(journal_of(store), "ab") as f:  # a new entry's line, its process killed before the file
        f.write(b'{"r":"ghost","at":%f,"p":9,"w":[],"c":%f}\n' % (now - 9, now))
    entry_file = store.queue_dir / "later.json"
    entry_file.unlink()  # as the entry is rewritten (a symlink, or a file where there are none) with no line
    entry_file.write_bytes(msgspec.json.encode({"at": now + 3600, "p": 0, "w": [], "c": now}))
    assert store.due(10) == ["kept"]
    assert store.due(10) == ["kept"]
    assert store.next_due() == pytest.approx(now + 3600)
    store.close()


def test_the_journal_is_compacted_as_changes_outnumber_entries(tmp_path: Path) -> None:
    from durably_py.storage import filedue

    state = tmp_path / "state"
    store = FileStorage(state)
    now = time.time()
    store.create("a", header("a"), at=now - 1)
    store.due(1)
    slack, filedue._COMPACT_SLACK = filedue._COMPACT_SLACK, 50  # type: ignore[attr-defined]
    try:
        for i in range(200):
            store.schedule("a", now - 1 - i)
            store.due(1)
        assert journal_of(store).read_bytes().count(b"\n") < 120
        assert store.due(1) == ["a"]
    finally:
        filedue._COMPACT_SLACK = slack  # type: ignore[attr-defined]
    store.close()


CHURN = textwrap.dedent("""
    import os, random, sys, time
    import msgspec
    from durably_py.storage import FileStorage, LOG_VERSION
    state, report, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    store = FileStorage(state)
    out = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    def say(kind, run_id):
        os.write(out, f"{kind} {run_id}\\n".encode())
    def header(run_id):
        return msgspec.json.encode({"t": "run", "v": LOG_VERSION, "run_id": run_id, "workflow": "wf",
                                    "key": None, "created_at": "2024"}) + b"\\n"
    END = msgspec.json.encode({"t": "end", "v": LOG_VERSION, "status": "completed", "result": 1,
                               "error": None, "ts": 1.0}) + b"\\n"
    parked = []
    n = 0
    while True:
        n += 1
        op = rng.random()
        if op < 0.45:
            run_id = f"s{seed}n{n}"
            store.create(run_id, header(run_id), at=None if rng.random() < 0.7 else time.time() + 0.2,
                         priority=rng.choice((0, 0, 1)))
            say("q", run_id)
        elif op < 0.85:
            leases = store.claim_due(f"w{seed}", 30, rng.randint(1, 4))
            ending = []
            for lease in leases:
                if rng.random() < 0.3:
                    store.schedule(lease.run_id, None, wait=("go",))
                    store.release(lease)
                    say("p", lease.run_id)
                    parked.append(lease.run_id)
                else:
                    store.append(lease, END)
                    ending.append(lease)
            for lease, error in zip(ending, store.finish_all(ending)):
                if error is None:
                    say("e", lease.run_id)
        elif parked:
            run_id = parked.pop(rng.randrange(len(parked)))
            store.wake(run_id, "go")
            say("w", run_id)
""")


def churn_and_kill(tmp_path: Path, rounds: int, procs: int) -> None:
    state, report = tmp_path / "state", tmp_path / "report"
    watcher = FileStorage(state)  # a long-lived process's view, kept across every kill
    rng = random.Random(rounds * 7919 + procs)
    kills = 0
    for round_ in range(rounds):
        children = [subprocess.Popen([sys.executable, "-c", CHURN, str(state), str(report),
                                      str(round_ * procs + i)]) for i in range(procs)]
        deadline = time.monotonic() + rng.uniform(0.3, 0.8)
        while time.monotonic() < deadline:
            watcher.due(8)
            time.sleep(0.01)
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait()
            kills += 1
    time.sleep(0.25)  # runs queued 0.2 s ahead fall due
    now = time.time()
    said: dict[str, list[str]] = {}
    for line in report.read_text().splitlines():
        kind, run_id = line.split()
        said.setdefault(run_id, []).append(kind)
    ended = {r for r, kinds in said.items() if "e" in kinds}
    parked = {r for r, kinds in said.items() if kinds[-1] == "p"}  # parked and not woken since
    waiting = set(said) - ended - parked
    for run_id in list(waiting):  # ended by a process killed before it said so
        log = (state / "runs" / f"{run_id}.jsonl").read_bytes()
        if b'"t":"end"' in log:
            waiting.discard(run_id)
    truth = truly_due(watcher, now)
    fresh = FileStorage(state)
    seen_by_watcher, seen_fresh = set(watcher.due(10**6, now)), set(fresh.due(10**6, now))
    print(f"\n{kills} processes SIGKILLed over {rounds} rounds: {len(said)} runs queued, {len(ended)} ended, "
          f"{len(parked)} parked, {len(truth)} due; the long-lived view and a fresh one agree with the files")
    assert not ended & truth  # an ended run is never due again
    queued = {name[:-5] for name in os.listdir(watcher.queue_dir) if name.endswith(".json")}
    assert waiting <= queued  # every run reported queued or woken that has not ended is still queued
    assert waiting & truth  # (most of them due: some were parked by a process killed before it said so)
    assert seen_by_watcher == truth
    assert seen_fresh == truth
    watcher.close()
    fresh.close()


def test_processes_sigkilled_while_they_queue_claim_park_wake_and_end_lose_no_queued_run(tmp_path: Path) -> None:
    churn_and_kill(tmp_path, rounds=3, procs=3)


@pytest.mark.slow
def test_many_rounds_of_sigkills_lose_no_queued_run(tmp_path: Path) -> None:
    churn_and_kill(tmp_path, rounds=30, procs=3)


def test_entries_and_bindings_written_as_regular_files_by_older_versions_are_read_and_replaced(
        tmp_path: Path) -> None:
    from durably_py.storage.base import NewRun

    state = tmp_path / "state"
    store = FileStorage(state)
    now = time.time()
    store.create_bound([NewRun("r1", header("r1"), "key-1"), NewRun("r2", header("r2"), "key-2")])
    store.create("r3", header("r3"), at=now + 3600)
    assert (state / "queue" / "r1.json").is_symlink()  # entries and batched bindings are symlinks now
    assert all(p.is_symlink() for p in (state / "index").iterdir())
    store.close()
    for run_id, fields in (("r1", {"at": now - 2, "p": 0, "w": [], "c": now}),
                           ("r2", {"at": now - 1, "p": 3, "w": ["go"], "c": now})):
        entry = state / "queue" / f"{run_id}.json"
        entry.unlink()
        entry.write_bytes(msgspec.json.encode(fields))  # as an older version wrote them
    for binding in (state / "index").iterdir():
        target = os.readlink(binding)
        binding.unlink()
        binding.write_text(target)
    (state / "queue" / JOURNAL).unlink(missing_ok=True)
    old = FileStorage(state)
    assert old.lookup("key-1") == "r1" and old.lookup("key-2") == "r2"
    assert old.due(10) == ["r2", "r1"]
    old.schedule("r2", None, wait=("go",))
    assert (state / "queue" / "r2.json").is_symlink() and old.entry("r2").wait == ("go",)
    assert old.wake("r2", "go") and old.due(10) == ["r2", "r1"]
    assert old.next_due() == pytest.approx(now + 3600)
    old.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_state_dir_still_answers_due_from_its_entry_files(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = FileStorage(state)
    store.create("r1", header("r1"))
    store.close()
    modes = {p: p.stat().st_mode for p in (state, state / "queue")}
    for p in modes:
        p.chmod(0o555)
    try:
        reader = FileStorage(state)
        assert reader.due(5) == ["r1"] and reader.due(5) == ["r1"]
        reader.close()
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
