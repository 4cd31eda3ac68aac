"""A batch of runs made on files (a served parent's children, `enqueue_many`), SIGKILLed at chosen points of the
batch: after the one due-journal append for its queue entries and before their files, among the entry files,
among the logs (each an unnamed file linked in). Resumed, every run exists once and runs once."""

import asyncio
import subprocess
import sys

import pytest
from helpers import FAN_OUT, fan_out_sum

from durably_py import FileStorage, create_engine

SCRIPT = """
import asyncio, os, signal, sys
from durably_py import FileStorage, create_engine, workflow

state, effects, mode, where, at = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
storage = FileStorage(state)
seen = {"journal": 0, "entry": 0, "create": 0}


def counted(name, method, after=False):
    def wrapper(*args, **kwargs):
        if where == name and seen[name] == at and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = method(*args, **kwargs)
        if where == name and seen[name] == at and after:
            os.kill(os.getpid(), signal.SIGKILL)
        seen[name] += 1
        return out
    return wrapper


def journal_append(method):
    def wrapper(lines):  # the batch's lines (more than one), killed once they are in the journal
        out = method(lines)
        if where == "journal" and len(lines) > 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapper


storage.queue._write_file = counted("entry", storage.queue._write_file)
storage.queue.journal.append = journal_append(storage.queue.journal.append)
storage._new_log = counted("create", storage._new_log)

""" + FAN_OUT + """

async def main():
    engine = create_engine(storage, concurrency=4)
    if mode == "served":  # the parent runs in a worker: its children are queued runs, made in one batch
        await engine.enqueue(mom, 12, key="mom")  # resumed: the same run (its key names it)
        await engine.drain()
        return (await engine.inspect("mom")).result
    handles = await engine.enqueue_many([(kid, n, f"kid-{n}") for n in range(12)])
    await engine.start()
    try:
        values = [await engine.join(h) for h in handles]
    finally:
        await engine.stop()
    return len({h.run_id for h in handles}) if values == list(range(12)) else values


print(asyncio.run(main()), flush=True)
"""


def _run(tmp_path, mode: str, where: str, at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(tmp_path / "batch.py"), str(tmp_path / "state"),
                           str(tmp_path / "effects.txt"), mode, where, str(at)],
                          capture_output=True, text=True, timeout=120)


# `enqueue_many` again waits RESERVED_WAIT for each run bound before the kill whose log never came (another
# process may be writing it): ~20 s each, so those are slow
SLOW = pytest.mark.slow


@pytest.mark.parametrize(("mode", "where", "at"), [
    ("served", "journal", 0), ("served", "entry", 5), ("served", "create", 5),
    pytest.param("many", "journal", 0, marks=SLOW), pytest.param("many", "entry", 7, marks=SLOW),
    pytest.param("many", "create", 3, marks=SLOW)])
def test_a_batch_killed_while_it_is_made_resumes_with_each_run_once(tmp_path, mode, where, at) -> None:
    """The kill comes inside the batch: the resumed parent (or the same `enqueue_many` again) finds each run made
    before the kill through its identity, makes the others, and each runs once; no run is left over that no
    identity names."""
    (tmp_path / "batch.py").write_text(SCRIPT)
    (tmp_path / "state").mkdir()
    (tmp_path / "effects.txt").touch()
    killed = _run(tmp_path, mode, where, at)
    assert killed.returncode == -9, killed.stderr
    done = _run(tmp_path, mode, "none", 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (fan_out_sum(12) if mode == "served" else "12")
    ran = sorted(int(n) for n in (tmp_path / "effects.txt").read_text().split())
    assert ran == list(range(12)), ran
    storage = FileStorage(tmp_path / "state")
    engine = create_engine(storage)
    kids = [r for r in asyncio.run(engine.list()) if r.workflow == "kid"]
    assert len(kids) == 12 and {k.status for k in kids} == {"completed"}, [(k.run_id, k.status) for k in kids]
    if mode == "served":
        named = [r["v"]["run_id"] for r in asyncio.run(engine.records("mom")) if r.get("l") == "ctx.spawn"]
        assert sorted(k.run_id for k in kids) == sorted(named)
    # every run ended, so none is queued; an entry written before the kill for a log never made is left, which
    # names no run (`due` skips it)
    assert all(storage.info(entry.run_id) is None for entry in storage.entries())
