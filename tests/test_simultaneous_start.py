"""Several processes starting the same run at the same moment agree on one run: the work happens once."""

import json
import subprocess
import sys
import textwrap
import time

from durably_py import FileStorage, create_engine

SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, time
    from durably_py import run, workflow

    state, effects, go = sys.argv[1], sys.argv[2], float(sys.argv[3])

    async def work(i):
        with open(effects, "a") as f:
            f.write(f"{i} {os.getpid()}\\n")
        await asyncio.sleep(0.05)
        return i * i

    @workflow
    async def squares(ctx, n):
        return [await ctx.step(work, i) for i in range(n)]

    while time.time() < go:
        time.sleep(0.0005)
    print(run(squares, 6, dir=state), flush=True)
""")


def test_processes_started_together_share_one_run(tmp_path) -> None:
    script = tmp_path / "squares.py"
    script.write_text(SCRIPT)
    state, effects = tmp_path / "state", tmp_path / "effects.txt"
    go = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, str(script), str(state), str(effects), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {str([i * i for i in range(6)])}
    lines = effects.read_text().split("\n")[:-1]
    assert sorted(int(line.split()[0]) for line in lines) == list(range(6))
    assert len({line.split()[1] for line in lines}) == 1
    runs = [json.loads(p.read_text().splitlines()[0])["run_id"] for p in (state / "runs").glob("*.jsonl")]
    assert len(runs) == 1
    (only,) = create_engine(FileStorage(state)).storage.list_runs()
    assert only.last["t"] == "end"
