"""Storage URLs: a directory, file:PATH, sqlite:PATH, postgresql://...; a bad one names the accepted forms."""

import asyncio

import pytest
from helpers import durably

from durably_py import FileStorage, SqliteStorage, ValidationError, create_engine, workflow
from durably_py._engine.engine import engine_for
from durably_py.storage.url import open_storage, parse_storage_url


@pytest.mark.parametrize(("url", "expected"), [
    (".durably", ("file", ".durably")),
    ("/var/lib/app/state", ("file", "/var/lib/app/state")),
    ("file:state", ("file", "state")),
    ("file:/abs/state", ("file", "/abs/state")),
    ("file:///abs/state", ("file", "/abs/state")),
    ("sqlite:runs.db", ("sqlite", "runs.db")),
    ("sqlite:state/runs.db", ("sqlite", "state/runs.db")),
    ("sqlite:/abs/runs.db", ("sqlite", "/abs/runs.db")),
    ("sqlite:///abs/runs.db", ("sqlite", "/abs/runs.db")),
    ("sqlite://rel/runs.db", ("sqlite", "rel/runs.db")),
    ("postgresql://app@db.internal/durably", ("postgres", "postgresql://app@db.internal/durably")),
    ("postgres://app:pw@db:5433/d?sslmode=require", ("postgres", "postgres://app:pw@db:5433/d?sslmode=require")),
])
def test_accepted_forms(url, expected) -> None:
    assert parse_storage_url(url) == expected


@pytest.mark.parametrize("url", ["", "   ", "mysql://db/x", "sqlite:", "sqlite:dir/", "file:", "postgresql:db",
                                 "postgresql://", "s3://bucket/x", "a\x00b", 42, None])
def test_bad_urls_name_the_accepted_forms(url) -> None:
    with pytest.raises(ValidationError) as info:
        parse_storage_url(url)
    assert "file:PATH" in str(info.value) and "sqlite:PATH" in str(info.value) and "postgresql://" in str(info.value)
    assert info.value.hint and info.value.docs


def test_open_storage_builds_each_adapter(tmp_path) -> None:
    files = open_storage(str(tmp_path / "a"))
    assert isinstance(files, FileStorage) and files.dir == tmp_path / "a"
    assert isinstance(open_storage(f"file:{tmp_path / 'b'}"), FileStorage)
    db = open_storage(f"sqlite:{tmp_path / 'x.db'}")
    assert isinstance(db, SqliteStorage)
    db.close()


def test_relative_sqlite_path_is_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = open_storage("sqlite:sub/runs.db")
    db.list_runs()
    db.close()
    assert (tmp_path / "sub" / "runs.db").exists()


def test_postgres_url_keeps_the_dsn_and_reads_the_schema() -> None:
    pytest.importorskip("psycopg")
    storage = open_storage("postgres://app@db.invalid/d?schema=staging&sslmode=disable")
    assert storage.schema == "staging"
    assert storage.dsn == "postgresql://app@db.invalid/d?sslmode=disable"


@workflow
async def double(ctx, x):
    return x * 2


def test_create_engine_accepts_a_url_and_the_environment(tmp_path, monkeypatch) -> None:
    engine = create_engine(f"sqlite:{tmp_path / 'e.db'}")
    assert isinstance(engine.storage, SqliteStorage)
    assert asyncio.run(engine.run(double, 4)) == 8
    monkeypatch.setenv("DURABLY_STORAGE", f"file:{tmp_path / 'envdir'}")
    from_env = create_engine()
    assert isinstance(from_env.storage, FileStorage) and from_env.storage.dir == tmp_path / "envdir"
    assert engine_for(None).storage.dir == tmp_path / "envdir"
    assert engine_for(str(tmp_path / "explicit")).storage.dir == tmp_path / "explicit"
    with pytest.raises(ValidationError, match="sqlite:PATH"):
        create_engine("ftp://x")


def test_cli_honours_durably_storage_and_a_bad_url_is_a_usage_error(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("from durably_py import workflow\n\n@workflow\nasync def triple(ctx, x):\n"
                      "    return await ctx.step(lambda: x * 3)\n")
    at = {"unset": ("DURABLY_DIR",), "pythonpath": False, "cwd": tmp_path}
    run = durably("run", str(script), "--workflow", "triple", "--input", "5", **at,
                  DURABLY_STORAGE=f"sqlite:{tmp_path / 'runs.db'}")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "runs.db").exists() and not (tmp_path / ".durably").exists()
    listed = durably("list", "--json", **at, DURABLY_STORAGE=f"sqlite:{tmp_path / 'runs.db'}")
    assert '"triple"' in listed.stdout
    bad = durably("list", **at, DURABLY_STORAGE="mysql://nope")
    assert bad.returncode == 2
    assert "sqlite:PATH" in bad.stderr
