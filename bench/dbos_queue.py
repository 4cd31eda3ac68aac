"""DBOS's durable queue under the same load as `bench/queues.py` gives durably: a backlog of short runs (three
async steps each) drained by 1, 2 or 4 worker processes. Run by `bench/queues.py` with an interpreter that has
`dbos` installed (`pip install dbos`, kept out of durably's own environment); prints one JSON line.

Usage: python bench/dbos_queue.py drain URL --runs M --workers N --concurrency C
       python bench/dbos_queue.py worker URL --concurrency C --name NAME   (started by `drain`)

URL is DBOS's system database: ``sqlite:///PATH`` or ``postgresql+psycopg://...``. Each worker is its own DBOS
process (its own `executor_id`) listening on one queue with `worker_concurrency` C and a 10 ms polling
interval (DBOS's default is 1 s; 10 ms is its best case here). The backlog is enqueued before any worker starts;
the rate is counted in the window where every worker is running, as in `bench/queues.py`: from the latest first
start among the workers to the earliest last end, the workflows that ended in it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

QUEUE = "bench"


def configure(url: str, name: str, concurrency: int) -> Any:
    from dbos import DBOS

    DBOS(config={"name": "durably-bench", "system_database_url": url, "executor_id": name,
                 "log_level": "WARNING"})

    @DBOS.step()
    async def work(i: int) -> int:
        return i + 1

    @DBOS.workflow(name="three")
    async def three(n: int) -> int:
        a = await work(n)
        b = await work(a)
        return await work(b)

    return DBOS, three


def worker(url: str, concurrency: int, name: str) -> None:
    dbos, _ = configure(url, name, concurrency)
    dbos.launch()
    dbos.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=0.01)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    while not stop["now"]:
        time.sleep(0.05)
    dbos.destroy(destroy_registry=True)


def drain(url: str, runs: int, workers: int, concurrency: int) -> dict[str, Any]:
    dbos, _ = configure(url, "enqueuer", concurrency)
    from dbos import DBOSClient

    dbos.launch()  # creates the system database's tables
    dbos.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=0.01)
    dbos.destroy(destroy_registry=True)
    client = DBOSClient(system_database_url=url)
    start = time.perf_counter()
    for n in range(runs):
        client.enqueue({"queue_name": QUEUE, "workflow_name": "three"}, n)
    enqueue_rate = runs / (time.perf_counter() - start)
    procs = [subprocess.Popen([sys.executable, __file__, "worker", url, "--concurrency", str(concurrency),
                               "--name", f"w{i}"]) for i in range(workers)]
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = client.list_workflows(status=["SUCCESS"], load_input=False, load_output=False)
            if len(done) >= runs:
                break
            time.sleep(0.25)
        rows = client.list_workflows(load_input=False, load_output=False)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        client.destroy()
    spans: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if row.status == "SUCCESS" and row.executor_id and row.executor_id.startswith("w"):
            started = (getattr(row, "started_at_epoch_ms", None) or row.created_at) / 1000
            spans.setdefault(row.executor_id, []).append((started, row.updated_at / 1000))
    return {"rate": window_rate(spans), "enqueue_rate": enqueue_rate, "ended": sum(len(s) for s in spans.values()),
            "runs": runs}


def window_rate(spans: dict[str, list[tuple[float, float]]]) -> float:
    """Runs ended per second while every worker was running: from the latest first start among the workers
    to the earliest last end (the whole span when one worker)."""
    if not spans:
        return 0.0
    begin = max(min(s for s, _ in runs) for runs in spans.values())
    end = min(max(e for _, e in runs) for runs in spans.values())
    ended = sum(1 for runs in spans.values() for _, e in runs if begin < e <= end)
    return ended / (end - begin) if end > begin else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["drain", "worker"])
    parser.add_argument("url")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--name", default="w0")
    opts = parser.parse_args()
    os.environ.setdefault("DBOS__APPVERSION", "bench")
    if opts.mode == "worker":
        worker(opts.url, opts.concurrency, opts.name)
    else:
        print(json.dumps(drain(opts.url, opts.runs, opts.workers, opts.concurrency)))


if __name__ == "__main__":
    main()
