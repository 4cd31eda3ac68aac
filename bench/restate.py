"""Restate mode against FileStorage: per-step latency, a 100-way fan-out and runs per second.

Usage: python bench/restate.py [--rounds R]   (needs the restate extra and .ci/restate's restate-server)

Starts a single-node restate-server (one partition, temporary dir) and serves this file's workflows
in a child process, next to a raw restate-sdk workflow doing the same sequential `ctx.run`s (the floor
durably's adapter is compared with). The same durably workflows then run on FileStorage in this
process. Prints medians over R rounds and the ratios to the floors measured in the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this file is named like the restate SDK's package: keep bench/ off the import path; add the project and tests/
sys.path[:] = [str(ROOT), str(ROOT / "tests")] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

from durably_py import Engine, FileStorage, workflow  # noqa: E402


async def noop(i: int) -> int:
    """An async step returning its argument."""
    return i


def noop_sync(i: int) -> int:
    """A sync (`def`) step returning its argument."""
    return i


@workflow
async def bench_seq(ctx: Any, n: int) -> int:
    """n sequential async steps."""
    total = 0
    for i in range(n):
        total += await ctx.step(noop, i)
    return total


@workflow
async def bench_seq_sync(ctx: Any, n: int) -> int:
    """n sequential sync steps."""
    total = 0
    for i in range(n):
        total += await ctx.step(noop_sync, i)
    return total


@workflow
async def bench_fan(ctx: Any, n: int) -> int:
    """n steps in one ctx.parallel."""
    return sum(r.value for r in await ctx.parallel([ctx.step(noop, i) for i in range(n)]))


@workflow
async def bench_branches(ctx: Any, n: int) -> int:
    """n branches of 3 sequential steps each."""
    async def branch(b: int) -> int:
        return sum([await ctx.step(noop, b * 3 + s) for s in range(3)])

    return sum(r.value for r in await ctx.parallel([lambda b=b: branch(b) for b in range(n)]))


def raw_service() -> Any:
    """The floor: the same sequential steps as plain restate-sdk `ctx.run`s."""
    import restate

    raw = restate.Workflow("raw.seq")

    @raw.main()
    async def run(ctx: Any, n: int) -> int:
        total = 0
        for i in range(n):
            total += await ctx.run_typed(f"noop{i}", noop, restate.RunOptions(), i)
        return total

    return raw


def serve(port: int) -> None:
    """Child process: serve the durably workflows and the raw one on `port` until SIGTERM."""
    import restate

    from durably_py.restate import workflow_service
    from durably_py.restate.server import serve_async

    services = [workflow_service(w) for w in (bench_seq, bench_seq_sync, bench_fan, bench_branches)]
    asyncio.run(serve_async(port=port, admin=None, asgi=restate.app([*services, raw_service()])))


def post(url: str, body: Any, timeout: float = 300) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--throughput", action="store_true",
                        help="Also measure runs/s with 4 concurrent clients.")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import subprocess

    from restate_env import RestateEnv, free_port

    env = RestateEnv([])
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        import socket

        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        post(f"{env.admin}/deployments", {"uri": f"http://127.0.0.1:{port}", "force": True})
        import os

        before = os.getloadavg()[0]
        results = measure(env.ingress, args.rounds, args.throughput)
        load = (before, os.getloadavg()[0])
    finally:
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            print("the benchmark's service did not stop on SIGTERM: killed", file=sys.stderr)
            child.kill()
            child.wait()
        env.close()
    report(results, args.rounds, load)


def measure(ingress: str, rounds: int, throughput: bool) -> dict[str, list[float]]:
    seq_n, fan_n, runs, clients = 100, 100, 40, 4
    out: dict[str, list[float]] = {}
    counter = iter(range(10**9))

    def restate_once(service: str, n: int) -> float:
        print(f"  {service}({n})", file=sys.stderr, flush=True)
        started = time.perf_counter()
        post(f"{ingress}/{service}/b{next(counter)}/run", n)
        return time.perf_counter() - started

    for _ in range(2):  # warm up both sides
        restate_once("durably.bench_seq", 10)
        restate_once("raw.seq", 10)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(FileStorage(tmp), concurrency=clients)

        async def files_once(wf: Any, n: int) -> float:
            started = time.perf_counter()
            await engine.run(wf, n, key=f"f{next(counter)}", advisories="silent")
            return time.perf_counter() - started

        async def files_throughput() -> float:
            started = time.perf_counter()
            await asyncio.gather(*(engine.run(bench_seq, 20, key=f"t{next(counter)}", advisories="silent")
                                   for _ in range(runs)))
            return runs / (time.perf_counter() - started)

        def restate_throughput() -> float:
            started = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(lambda _: restate_once("durably.bench_seq", 20), range(runs)))
            return runs / (time.perf_counter() - started)

        for _ in range(rounds):
            out.setdefault("raw seq ms/step", []).append(restate_once("raw.seq", seq_n) * 1000 / seq_n)
            out.setdefault("restate seq ms/step", []).append(restate_once("durably.bench_seq", seq_n) * 1000 / seq_n)
            out.setdefault("restate seq def ms/step", []).append(
                restate_once("durably.bench_seq_sync", seq_n) * 1000 / seq_n)
            out.setdefault("files seq ms/step", []).append(asyncio.run(files_once(bench_seq, seq_n)) * 1000 / seq_n)
            out.setdefault("files seq def ms/step", []).append(
                asyncio.run(files_once(bench_seq_sync, seq_n)) * 1000 / seq_n)
            out.setdefault("restate fan-out 100 ms", []).append(restate_once("durably.bench_fan", fan_n) * 1000)
            out.setdefault("files fan-out 100 ms", []).append(asyncio.run(files_once(bench_fan, fan_n)) * 1000)
            out.setdefault("restate 10x3 branches ms", []).append(restate_once("durably.bench_branches", 10) * 1000)
            out.setdefault("files 10x3 branches ms", []).append(asyncio.run(files_once(bench_branches, 10)) * 1000)
            if throughput:
                out.setdefault("restate runs/s (seq 20, 4 clients)", []).append(restate_throughput())
                out.setdefault("files runs/s (seq 20, concurrency 4)", []).append(asyncio.run(files_throughput()))
        engine.executor.shutdown()
    return out


def report(results: dict[str, list[float]], rounds: int, load: tuple[float, float]) -> None:
    import os

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"medians of {rounds} rounds; 100 sequential steps per run, fan-out of 100 plain steps; "
          f"{os.cpu_count()} cores, load average {load[0]:.1f} before and {load[1]:.1f} after")
    print(f"{'measure':<40}{'median':>10}")
    for name, value in med.items():
        print(f"{name:<40}{value:>10.3f}")
    print()
    print(f"durably adapter / raw restate-sdk, sequential steps: {med['restate seq ms/step'] / med['raw seq ms/step']:.2f}x")
    print(f"restate / files, sequential async steps:             {med['restate seq ms/step'] / med['files seq ms/step']:.1f}x")
    print(f"restate / files, sequential def steps:               {med['restate seq def ms/step'] / med['files seq def ms/step']:.1f}x")
    print(f"restate / files, fan-out of 100:                     {med['restate fan-out 100 ms'] / med['files fan-out 100 ms']:.1f}x")
    print(f"restate / files, 10 branches x 3 steps:              "
          f"{med['restate 10x3 branches ms'] / med['files 10x3 branches ms']:.1f}x")
    if "restate runs/s (seq 20, 4 clients)" in med:
        print(f"files / restate, runs per second:                    "
              f"{med['files runs/s (seq 20, concurrency 4)'] / med['restate runs/s (seq 20, 4 clients)']:.1f}x")


if __name__ == "__main__":
    main()
