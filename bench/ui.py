"""The web console under load: first paint of a 10,000-step run page, and the runs page over 100,000 runs.

    python bench/ui.py                      # ~1-2 min: 10,000 steps, 100,000 runs (FileStorage)
    python bench/ui.py --steps 2000 --runs 20000
    python bench/ui.py --runs 0             # the run page only

Each figure is printed next to a floor measured in the same run on the same files: reading and
parsing the run's whole log (run page), or reading the first and last line of every run's log (runs
page). Browser figures (headless Chromium through Playwright) are measured when Debian's `chromium`
is installed; they run from navigation start to the first step row / run row on screen (a big run's
page paints its first steps before the rest of the run and its timeline arrive; the bars row times those).
Nothing here passes or fails: it prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from durably_py import Engine, FileStorage, workflow  # noqa: E402

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]


async def noop(i: int) -> int:
    return i


@workflow
async def big(ctx: Any, n: int) -> int:
    """n sequential async steps."""
    for i in range(n):
        await ctx.step(noop, i, name="step")
    return n


def median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def raw_log_read(path: Path) -> None:
    """The floor of a run page: read the whole log and parse every line."""
    for line in path.read_bytes().splitlines():
        json.loads(line)


def raw_ends(runs_dir: Path) -> None:
    """The floor of a runs page: the first and last line of every run's log."""
    for name in os.listdir(runs_dir):
        if name.endswith(".jsonl"):
            with open(runs_dir / name, "rb") as f:
                json.loads(f.readline())
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - 512))
                json.loads(f.read().rstrip().rsplit(b"\n", 1)[-1])


def make_store(state: Path, runs: int) -> None:
    """`runs` runs: one real run, its log and owner sidecar copied under new ids, keys, workflows and times."""
    engine = Engine(FileStorage(state))
    asyncio.run(engine.run(big, 3, key="template"))
    runs_dir = state / "runs"
    (template,) = [p for p in runs_dir.glob("*.jsonl")]
    old_id = template.stem
    text = template.read_text()
    owner = (runs_dir / f"{old_id}.owner").read_text() if (runs_dir / f"{old_id}.owner").exists() else None
    base = time.time() - runs
    for i in range(1, runs):
        run_id = f"job{i % 7}-20260501-{i:08x}"
        body = text.replace(old_id, run_id).replace('"key":"template"', f'"key":"batch-{i}"') \
                   .replace('"workflow":"big"', f'"workflow":"job{i % 7}"')
        path = runs_dir / f"{run_id}.jsonl"
        path.write_text(body)
        if owner is not None:
            (runs_dir / f"{run_id}.owner").write_text(owner)
        os.utime(path, (base + i, base + i))


def serve(state: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--dir", str(state), "--port", "0"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    found = re.search(r"http://\S+", proc.stderr.readline())
    assert found, "durably ui did not start"
    return proc, found.group(0).rstrip("/")


def first_event_ms(url: str) -> float:
    """Time to the first server-sent event of a stream (the data a page paints first)."""
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as stream:
        while True:
            line = stream.readline()
            if line.startswith(b"data: "):
                return (time.perf_counter() - began) * 1000


def get(url: str) -> None:
    """One plain GET, its body read."""
    with urllib.request.urlopen(url, timeout=120) as answer:
        answer.read()


def browser_ms(url: str, selector: str, repeat: int) -> float | None:
    """Median time from navigation start to `selector` on screen, in headless Chromium (None without it)."""
    if CHROMIUM is None:
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        for _ in range(repeat):
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            began = time.perf_counter()
            page.goto(url, wait_until="commit")
            page.wait_for_selector(selector, timeout=120_000)
            times.append((time.perf_counter() - began) * 1000)
            page.close()
        browser.close()
    return statistics.median(times)


def row(what: str, ms: float | None, floor: float | None = None) -> None:
    if ms is None:
        print(f"| {what} | (no chromium) | |")
        return
    ratio = f"{ms / floor:.1f}x" if floor else ""
    print(f"| {what} | {ms:,.1f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="durably-bench-ui-"))
    try:
        # ---- a run page with many steps ----
        state = tmp / "big" / ".durably"
        engine = Engine(FileStorage(state))
        asyncio.run(engine.run(big, args.steps, key="big"))
        asyncio.run(engine.run(big, 3, key="small"))
        run_id = engine.resolve("big")
        log = state / "runs" / f"{run_id}.jsonl"

        async def snapshot() -> None:
            await engine.inspect(run_id)
            await engine.timeline(run_id)
            await engine.graph(run_id)

        floor = median_ms(lambda: raw_log_read(log), args.repeat)
        print(f"\n{args.steps:,}-step run page ({log.stat().st_size / 1e6:.1f} MB log)\n")
        print("| measurement | ms (median) | x floor |\n| --- | ---: | ---: |")
        row("floor: read and parse the whole log", floor)
        row("Engine.inspect + timeline + graph", median_ms(lambda: asyncio.run(snapshot()), args.repeat), floor)
        proc, url = serve(state)
        try:
            row("HTTP: first event of /api/runs/{id}/events",
                statistics.median(first_event_ms(f"{url}/api/runs/{run_id}/events") for _ in range(args.repeat)), floor)
            small = browser_ms(f"{url}/runs/small", ".wf-row", args.repeat)
            row("browser baseline: the same for a 3-step run page", small)
            row("browser: navigation to first step row painted",
                browser_ms(f"{url}/runs/{run_id}", ".wf-row", args.repeat), floor)
            row("browser: navigation to the timeline's bars painted",
                browser_ms(f"{url}/runs/{run_id}", ".wf-row .bar", args.repeat), floor)
        finally:
            proc.terminate()
            proc.wait(timeout=10)

        # ---- a runs page over many runs ----
        if args.runs < 1:
            return
        state = tmp / "many" / ".durably"
        began = time.perf_counter()
        make_store(state, args.runs)
        print(f"\nruns page over {args.runs:,} runs (store made in {time.perf_counter() - began:.0f} s)\n")
        engine = Engine(FileStorage(state))
        runs_dir = state / "runs"
        floor = median_ms(lambda: raw_ends(runs_dir), args.repeat)
        print("| measurement | ms (median) | x floor |\n| --- | ---: | ---: |")
        row("floor: first and last line of every log", floor)
        row("Engine.list(limit=51): first page",
            median_ms(lambda: asyncio.run(engine.list(limit=51)), args.repeat), floor)
        row(f"Engine.list(limit=51, offset={args.runs // 2:,})",
            median_ms(lambda: asyncio.run(engine.list(limit=51, offset=args.runs // 2)), args.repeat), floor)
        row("Engine.list(workflow='job3', status='completed', limit=51)",
            median_ms(lambda: asyncio.run(engine.list(workflow="job3", status="completed", limit=51)), args.repeat),
            floor)
        row("Engine.list(search='batch-4242')",
            median_ms(lambda: asyncio.run(engine.list(search="batch-4242")), args.repeat), floor)
        proc, url = serve(state)
        try:
            row("HTTP: first event of /api/events (page of 50)",
                statistics.median(first_event_ms(f"{url}/api/events?limit=51") for _ in range(args.repeat)), floor)
            row("HTTP: /api/count (every run)", median_ms(lambda: get(f"{url}/api/count"), args.repeat), floor)
            row("HTTP: /api/count?q=batch-4242 (a search)",
                median_ms(lambda: get(f"{url}/api/count?q=batch-4242"), args.repeat), floor)
            row("browser: navigation to first run row painted", browser_ms(f"{url}/", "tr[data-run]", args.repeat),
                floor)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
