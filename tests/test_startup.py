"""`durably run SCRIPT [ARGS]` without options starts without importing typer, click or rich, and behaves
exactly as through typer: script arguments, `--`, `$DURABLY_DIR`, exit codes, the summary's text."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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
    from durably_py._launcher import main
    sys.argv = ["durably", *sys.argv[1:]]
    try:
        main()
    finally:
        heavy = sorted({m.split(".")[0] for m in sys.modules} & {"pydantic", "typer", "click", "rich"})
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
    assert "'typer'" in done.stderr.splitlines()[-1]


def test_run_on_restate_goes_through_the_full_parser(tmp_path: Path) -> None:
    setup(tmp_path)
    for env in ({"DURABLY_RESTATE": "http://127.0.0.1:9"}, {}):
        if not env:
            (tmp_path / ".durably").mkdir(exist_ok=True)
            (tmp_path / ".durably" / "config.toml").write_text('restate = "http://127.0.0.1:9"\n')
        done = durably(tmp_path, "run", "job.py", **env)
        assert done.returncode != 0
        assert "'typer'" in done.stderr.splitlines()[-1] and "--workflow" in done.stderr, done.stderr


def test_plain_lines_are_what_rich_prints_off_a_terminal(monkeypatch: Any, capsys: Any) -> None:
    from rich.console import Console
    from rich.text import Text

    from durably_py import _run_command as run_command

    lines = [[("✓", "green"), " ", ("run-1", "bold"), "  a\tb\rc\x07d"], [("  two\n\tlines", "red")]]
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    run_command.err_print(*lines)
    plain = capsys.readouterr().err
    expected = io.StringIO()
    console = Console(file=expected, highlight=False, soft_wrap=True)
    for line in lines:
        console.print(Text.assemble(*line))
    assert plain == expected.getvalue()
    monkeypatch.setenv("FORCE_COLOR", "1")
    run_command.err_print(*lines)
    assert "\x1b[" in capsys.readouterr().err
