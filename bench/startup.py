"""Start-up cost: `durably run` of a 1-step script against `python script.py` and a bare interpreter.

Usage: python bench/startup.py [--repeat R]

Each command runs R times, interleaved, each in a fresh working directory (so every run creates its
state directory and log); the table reports the min and the median wall time and CPU time (user +
system, steadier than wall time on a busy machine) of the whole process. Bytecode caching is on (as
on a user's machine) whatever PYTHONDONTWRITEBYTECODE says here, and a first untimed round compiles it.
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

TARGET = 100 / 73  # the target, 100 ms where `python job.py` took 73 ms, as a ratio


def durably_command() -> list[str]:
    """The installed `durably` script next to this interpreter, else `python -m durably_py.cli`."""
    script = Path(sys.executable).with_name("durably")
    return [str(script)] if script.exists() else [sys.executable, "-m", "durably_py.cli"]


def timed(command: list[str], script: Path) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of `command` run in a fresh directory holding a copy of `script`."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(script, Path(tmp) / "job.py")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DURABLY_") and k != "PYTHONDONTWRITEBYTECODE"}
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}")
        return wall, usage.ru_utime + usage.ru_stime


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
        walls: dict[str, list[float]] = {name: [] for name in rows}
        cpus: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.repeat):
            for name, command in rows.items():
                wall, cpu = timed(command, script)
                walls[name].append(wall)
                cpus[name].append(cpu)
    base = statistics.median(cpus["python job.py"])
    print(f"{args.repeat} interleaved rounds, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          "wall and CPU (user+system) ms of the whole process")
    print(f"{'command':<32}{'wall min':>9}{'median':>8}{'cpu min':>9}{'median':>8}{'x job.py (cpu)':>16}")
    for name in rows:
        w, c = walls[name], cpus[name]
        print(f"{name:<32}{min(w) * 1000:>9.1f}{statistics.median(w) * 1000:>8.1f}{min(c) * 1000:>9.1f}"
              f"{statistics.median(c) * 1000:>8.1f}{statistics.median(c) / base:>16.2f}")
    ratio = statistics.median(cpus["durably run job.py"]) / base
    print(f"durably run job.py: {ratio:.2f}x python job.py in CPU time (target: 100 ms where python job.py takes "
          f"73 ms, <= {TARGET:.2f}x: {'met' if ratio <= TARGET else 'not met'})")


if __name__ == "__main__":
    main()
