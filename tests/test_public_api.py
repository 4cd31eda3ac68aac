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
