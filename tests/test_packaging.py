"""What a `pip install` ships: the licence, the docs error messages point to, py.typed, the CLI entry points."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from functools import partial
from pathlib import Path

import typer
from helpers import durably as run_cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


durably = partial(run_cli, module="durably_py", columns=80, pythonpath=False)


def test_license_file_matches_the_declared_licence() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "MIT"}
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_docs_and_py_typed_ship_inside_the_package() -> None:
    shipped = PYPROJECT["tool"]["setuptools"]["package-data"]["durably_py"]
    assert "docs/*.md" in shipped and "py.typed" in shipped
    assert (ROOT / "durably_py" / "py.typed").is_file()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages and sorted(p.name for p in (ROOT / "durably_py" / "docs").glob("*.md")) == pages


def test_typer_major_version_is_the_one_the_help_output_was_written_for() -> None:
    assert typer.__version__.split(".")[0] == "0" and int(typer.__version__.split(".")[1]) < 29
    # held below 0.29, which requires pydantic and imports it on every command (README: Dependencies)
    assert any(dep.startswith("typer") and "<0.29" in dep for dep in PYPROJECT["project"]["dependencies"])
    loaded = subprocess.run([sys.executable, "-c", "import sys, durably_py.cli.app; "
                             "print(any(m.partition('.')[0] == 'pydantic' for m in sys.modules))"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"  # the CLI loads no pydantic, installed or not
    shown = durably("list", "--help").stdout
    assert "Usage: durably list [OPTIONS]" in shown and "--status" in shown and "--dir" in shown


def test_python_m_durably_py_version_and_completion() -> None:
    from durably_py import __version__

    version = durably("--version")
    assert version.returncode == 0 and version.stdout == f"durably {__version__}\n"
    assert durably("--version", module="durably_py.cli").stdout == version.stdout
    completion = run_cli(module="durably_py", pythonpath=False, _DURABLY_COMPLETE="complete_bash",
                         COMP_WORDS="durably li", COMP_CWORD="1")
    assert completion.stdout.split() == ["list"]


def test_error_docs_pointers_open_and_durably_docs_prints_them(tmp_path: Path) -> None:
    missing = durably("inspect", "nope", "--dir", str(tmp_path))
    assert missing.returncode == 2
    docs_line = next(line for line in missing.stderr.splitlines() if line.strip().startswith("docs:"))
    path = Path(docs_line.split("docs:")[1].split()[0])
    assert path.is_file() and path.name == "errors.md"
    assert "`durably docs errors#runnotfounderror` prints it" in docs_line
    section = durably("docs", "errors#runnotfounderror")
    assert section.returncode == 0 and section.stdout.startswith("## RunNotFoundError\n")
    assert "## " not in section.stdout.split("\n", 1)[1]
    page = durably("docs", "errors")
    assert page.stdout == (ROOT / "docs" / "errors.md").read_text()
    unknown = durably("docs", "nope")
    assert unknown.returncode == 2 and "no docs page 'nope'" in unknown.stderr and "errors" in unknown.stderr
