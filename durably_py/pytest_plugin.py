"""pytest plugin: the `durably_engine` fixture, a fresh `TestEngine` per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .testing import TestEngine


@pytest.fixture
def durably_engine() -> Iterator[TestEngine]:
    """A fresh TestEngine (memory storage, fake clock, shadow replay on); plain tests call `durably_engine.sync`."""
    engine = TestEngine()
    try:
        yield engine
    finally:
        engine.close()
