"""A throwaway PostgreSQL server for the benchmarks that compare adapters (`queues.py`): initdb in a temporary
directory, listening only on a unix socket there, with `fsync` on (durable commits cost what they cost on a real
server), stopped and removed afterwards. As root it runs as the `postgres` system user (`runuser`)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin")


def bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    dirs = [Path(d) for g in GLOBS for d in glob.glob(g) if (Path(d) / "initdb").exists()]
    dirs.sort(key=lambda d: [int(p) for p in re.findall(r"\d+", str(d))])
    return dirs[-1] if dirs else None


@contextlib.contextmanager
def throwaway() -> Iterator[tuple[str, str]]:
    """Yield (socket directory, durably storage URL of the `postgres` database) of a fresh server; raise
    RuntimeError when none can be started here."""
    bins = bindir()
    if bins is None:
        raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl) found")
    prefix: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="durably-bench-pg-"))
    if os.geteuid() == 0:
        import pwd

        entry = pwd.getpwnam("postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data, log = root / "data", root / "server.log"

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *args], cwd=root, capture_output=True, text=True, timeout=120)

    done = call(str(bins / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
    if done.returncode == 0:
        done = call(str(bins / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data), "-l", str(log), "-o",
                    f"-k {root} -c listen_addresses='' -c max_connections=200")
    if done.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"could not start PostgreSQL: {done.stderr.strip()[-500:]}")
    try:
        yield str(root), f"postgresql://postgres@localhost/postgres?host={root}"
    finally:
        call(str(bins / "pg_ctl"), "stop", "-D", str(data), "-m", "fast", "-w")
        shutil.rmtree(root, ignore_errors=True)
