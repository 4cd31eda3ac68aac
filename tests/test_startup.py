"""`durably run SCRIPT [ARGS]` without options starts without typer's parser or rich's live view, and
behaves exactly as through typer: script arguments, `--`, `$DURABLY_DIR`, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import json, sys
    from durably_py import run, workflow

    def hello(name):
        return f"hello {name}"

    @workflow
    async def greet(ctx, name):
        return await ctx.step(hello, name)

    if __name__ == "__main__":
        print(json.dumps({"argv": sys.argv[1:], "result": run(greet, "world")}))
        if "fail" in sys.argv:
            raise SystemExit(4)
''')

PROBE = textwrap.dedent('''
    import sys
    from durably_py.cli import main
    sys.argv = ["durably", *sys.argv[1:]]
    try:
        main()
    finally:
        heavy = [m for m in ("pydantic", "typer._adapters", "rich.live", "rich.table", "rich.tree") if m in sys.modules]
        print("HEAVY", heavy, file=sys.stderr)
''')


def durably(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")} | env
    return subprocess.run([sys.executable, str(cwd / "probe.py"), *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=60)


def setup(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def test_run_without_options_skips_the_heavy_imports_and_passes_arguments(tmp_path: Path) -> None:
    setup(tmp_path)
    done = durably(tmp_path, "run", "job.py", "a", "--", "--flag", "-x")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"argv": ["a", "--flag", "-x"], "result": "hello world"}
    assert "HEAVY []" in done.stderr
    assert "completed" in done.stderr and (tmp_path / ".durably").is_dir()


def test_run_without_options_reads_durably_dir_and_keeps_exit_codes(tmp_path: Path) -> None:
    setup(tmp_path)
    done = durably(tmp_path, "run", "job.py", "fail", DURABLY_DIR=str(tmp_path / "state"))
    assert done.returncode == 4, done.stderr
    assert (tmp_path / "state").is_dir() and not (tmp_path / ".durably").exists()
    missing = durably(tmp_path, "run", "nope.py")
    assert missing.returncode == 2 and "no script file" in missing.stderr


def test_run_with_an_option_goes_through_the_full_parser(tmp_path: Path) -> None:
    setup(tmp_path)
    done = durably(tmp_path, "run", "job.py", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads([line for line in done.stderr.splitlines() if line.startswith("{")][-1])
    assert summary["exit_code"] == 0 and summary["runs"]
