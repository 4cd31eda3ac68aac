"""The declared public surface: a sorted `__all__` whose every name resolves, and the package ships `py.typed`."""

from __future__ import annotations

from pathlib import Path

import durably_py


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert durably_py.__all__ == sorted(durably_py.__all__)
    assert len(set(durably_py.__all__)) == len(durably_py.__all__)
    for name in durably_py.__all__:
        assert getattr(durably_py, name) is not None
    assert {"PostgresStorage", "CorruptLogError", "LogVersionError", "StorageFullError"} <= set(durably_py.__all__)


def test_the_package_is_typed() -> None:
    assert (Path(durably_py.__file__).parent / "py.typed").is_file()


PUBLIC_MODULES = {"__init__", "__main__", "errors", "pytest_plugin", "records", "testing"}
PUBLIC_PACKAGES = {"agents", "cli", "restate", "storage", "ui"}


def test_every_other_module_is_named_internal() -> None:
    """docs/architecture.md: a module outside the public surface starts with an underscore."""
    package = Path(durably_py.__file__).parent
    named = {path.stem for path in package.glob("*.py")}
    assert PUBLIC_MODULES <= named
    assert sorted(name for name in named - PUBLIC_MODULES if not name.startswith("_")) == []
    packages = {path.name for path in package.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert PUBLIC_PACKAGES <= packages
    assert sorted(name for name in packages - PUBLIC_PACKAGES if not name.startswith("_")) == []
    assert {"_authoring", "_engine", "_replay", "_state", "_view", "_worker"} <= packages  # the layers
