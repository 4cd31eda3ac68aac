"""Start-up cost: `durably run` of a 1-step script against `python script.py` and a bare interpreter.

Usage: python bench/startup.py [--repeat R]

Each command runs R times, interleaved, each in a fresh working directory (so every run creates its
state directory and log); the table reports the min and the median wall time of the whole process.
Bytecode caching is on (as on a user's machine) whatever PYTHONDONTWRITEBYTECODE says here, and a
first untimed round compiles it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = '''
from durably_py import run, workflow


def hello(name):
    return f"hello {name}"


@workflow
async def greet(ctx, name):
    return await ctx.step(hello, name)


if __name__ == "__main__":
    print(run(greet, "world"))
'''


def durably_command() -> list[str]:
    """The installed `durably` script next to this interpreter, else `python -m durably_py.cli`."""
    script = Path(sys.executable).with_name("durably")
    return [str(script)] if script.exists() else [sys.executable, "-m", "durably_py.cli"]


def timed(command: list[str], script: Path) -> float:
    """Wall seconds of `command` run in a fresh directory holding a copy of `script`."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(script, Path(tmp) / "job.py")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DURABLY_") and k != "PYTHONDONTWRITEBYTECODE"}
        started = time.perf_counter()
        subprocess.run(command, cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(SCRIPT)
        rows = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import durably_py'": [sys.executable, "-c", "import durably_py"],
            "python job.py": [sys.executable, "job.py"],
            "durably run job.py": [*durably_command(), "run", "job.py"],
            "durably --help": [*durably_command(), "--help"],
        }
        for command in rows.values():
            timed(command, script)
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.repeat):
            for name, command in rows.items():
                times[name].append(timed(command, script))
    base = statistics.median(times["python job.py"])
    print(f"{args.repeat} interleaved rounds, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'command':<32}{'min ms':>8}{'median ms':>11}{'x python job.py':>17}")
    for name, values in times.items():
        mid = statistics.median(values)
        print(f"{name:<32}{min(values) * 1000:>8.1f}{mid * 1000:>11.1f}{mid / base:>17.2f}")
    durably = statistics.median(times["durably run job.py"]) * 1000
    print(f"durably run job.py: {durably:.0f} ms median (target <= 100 ms: {'met' if durably <= 100 else 'not met'})")


if __name__ == "__main__":
    main()
