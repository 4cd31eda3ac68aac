"""Tests for durably_py._state.advisories: the catalogue, level thresholds and the per-run tracker."""

from __future__ import annotations

import datetime as dt
import io
import re
from pathlib import Path
from typing import Any

import pytest

from durably_py._docs import DOCS_DIR
from durably_py._state import advisories as adv
from durably_py._state.advisories import CODES, Advisory, AdvisoryTracker, RetryStormWindow, level_for
from durably_py.errors import ValidationError

T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
ALL_CODES = [
    "LOOP_SUGGESTED",
    "FANOUT_CEILING",
    "RETRY_STORM",
    "STASH_SUGGESTED",
    "BUDGET_NEAR",
    "WAITFOR_NO_TIMEOUT",
    "SNAPSHOT_HEAVY",
    "SLOW_STEP_NO_TIMEOUT",
    "CONCURRENCY_CAPPED",
]


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> dt.datetime:
        self.t += dt.timedelta(seconds=1)
        return self.t


def tracker(**kwargs: Any) -> tuple[AdvisoryTracker, list[Advisory], io.StringIO]:
    seen: list[Advisory] = []
    stream = io.StringIO()
    kwargs.setdefault("on_advisory", seen.append)
    kwargs.setdefault("stream", stream)
    return AdvisoryTracker("run-1", now=Clock(), **kwargs), seen, stream


# --- catalogue ------------------------------------------------------------------------------------


def test_catalogue_has_all_nine_codes() -> None:
    assert sorted(CODES) == sorted(ALL_CODES)
    for code, entry in CODES.items():
        assert entry.code == code
        assert entry.trigger and entry.hint and entry.message and entry.measure
        assert entry.docs == f"docs/advisories.md#{code.lower()}"
        assert entry.info_at is not None
        assert entry.warn_at is None or entry.warn_at > entry.info_at


def test_docs_have_one_section_per_code() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "advisories.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in re.findall(r"^## (.+)$", text, re.M)}
    for entry in CODES.values():
        assert entry.docs.split("#")[1] in anchors


# --- level_for thresholds -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "below", "info", "warn"),
    [
        ("LOOP_SUGGESTED", 99, 100, 1000),
        ("FANOUT_CEILING", 999, 1000, 10_000),
        ("RETRY_STORM", 9, 10, 50),
        ("STASH_SUGGESTED", 29.9, 30, 300),
        ("BUDGET_NEAR", 0.79, 0.8, 0.95),
        ("SNAPSHOT_HEAVY", 256 * 1024 - 1, 256 * 1024, 1024 * 1024),
        ("SLOW_STEP_NO_TIMEOUT", 59.9, 60, 300),
    ],
)
def test_level_for_two_levels(code: str, below: float, info: float, warn: float) -> None:
    assert level_for(code, below) is None
    assert level_for(code, info) == "info"
    assert level_for(code, (info + warn) / 2) == "info"
    assert level_for(code, warn) == "warn"
    assert level_for(code, warn * 10) == "warn"


@pytest.mark.parametrize("code", ["WAITFOR_NO_TIMEOUT", "CONCURRENCY_CAPPED"])
def test_level_for_info_only(code: str) -> None:
    assert level_for(code, 0) is None
    assert level_for(code, 1) == "info"
    assert level_for(code, 1_000_000) == "info"


def test_level_for_unknown_code() -> None:
    with pytest.raises(ValidationError, match="unknown advisory code"):
        level_for("NOPE", 1)


def test_retry_storm_window_needs_failures() -> None:
    window = RetryStormWindow()
    for _ in range(9):
        assert window.record(failed=True, retry=True) is None
    assert window.record(failed=True, retry=True) == "info"
    for _ in range(20):
        window.record(failed=False, retry=True)
    assert window.retries == 30
    assert window.failure_ratio == 0.0
    assert window.level() is None
    for _ in range(10):
        window.record(failed=True, retry=True)
    assert window.failure_ratio == 0.5
    assert window.level() == "info"
    for _ in range(10):
        window.record(failed=True, retry=True)
    assert window.level() == "warn"
    assert window.fmt() == {"retries": 50, "failure_pct": 100}


def test_retry_storm_window_first_attempts_are_not_retries() -> None:
    window = RetryStormWindow()
    for _ in range(100):
        window.record(failed=True, retry=False)
    assert window.retries == 0 and window.level() is None


# --- tracker: dedupe and severity crossings -------------------------------------------------------


def test_dedupe_by_code() -> None:
    t, seen, _ = tracker()
    first = t.report("LOOP_SUGGESTED", "info", "100 steps")
    assert first is not None and first.count == 1 and first.first_at == T0 + dt.timedelta(seconds=1)
    assert t.report("LOOP_SUGGESTED", "info", "101 steps") is None
    assert t.report("LOOP_SUGGESTED", "info", "102 steps") is None
    assert len(seen) == 1
    [active] = t.active()
    assert active.count == 3 and active.msg == "100 steps"


def test_info_then_warn_emits_twice() -> None:
    t, seen, stream = tracker()
    assert t.report("LOOP_SUGGESTED", "info", "100 steps") is not None
    second = t.report("LOOP_SUGGESTED", "warn", "1000 steps")
    assert second is not None and second.level == "warn" and second.count == 2 and second.msg == "1000 steps"
    assert second.first_at == seen[0].first_at
    assert [a.level for a in seen] == ["info", "warn"]
    assert stream.getvalue().count("\n") == 2
    assert t.report("LOOP_SUGGESTED", "warn", "2000 steps") is None
    assert t.report("LOOP_SUGGESTED", "info", "again") is None
    assert len(seen) == 2 and t.active()[0].count == 4


def test_warn_then_info_emits_once() -> None:
    t, seen, stream = tracker()
    assert t.report("SNAPSHOT_HEAVY", "warn", "big") is not None
    assert t.report("SNAPSHOT_HEAVY", "info", "smaller") is None
    assert len(seen) == 1 and stream.getvalue().count("\n") == 1
    assert t.active()[0].level == "warn" and t.active()[0].count == 2


def test_emitted_advisory_is_a_snapshot() -> None:
    t, seen, _ = tracker()
    first = t.report("BUDGET_NEAR", "info", "80%")
    t.report("BUDGET_NEAR", "info", "81%")
    assert first is not None and first.count == 1 and seen[0].count == 1
    t.active()[0].count = 99
    assert t.active()[0].count == 2


def test_cap_of_ten_codes() -> None:
    t, seen, _ = tracker()
    codes = [f"C{i}" for i in range(11)]
    try:
        for i, fake in enumerate(codes):
            adv.CODES[fake] = adv.AdvisoryCode(fake, "test", "n", 1, 2, "m", "h")
            assert (t.report(fake, "info", "x") is None) == (i == 10)
        assert len(t.active()) == 10 and len(seen) == 10
        assert "C10" not in {a.code for a in t.active()}
        assert t.report("C10", "warn", "still dropped") is None
        assert t.report("C0", "warn", "known code escalates") is not None
    finally:
        for fake in codes:
            adv.CODES.pop(fake, None)


def test_cap_uses_real_codes() -> None:
    t, seen, _ = tracker()
    for code in ALL_CODES:
        t.report(code, "info", code)
    assert len(t.active()) == 9 and len(seen) == 9


def test_unknown_code_and_level_rejected() -> None:
    t, _, _ = tracker()
    with pytest.raises(ValidationError):
        t.report("NOPE", "info", "x")
    with pytest.raises(ValidationError):
        t.report("LOOP_SUGGESTED", "error", "x")


# --- printing -------------------------------------------------------------------------------------


def test_stderr_printed_once_per_level(capsys: pytest.CaptureFixture[str]) -> None:
    t = AdvisoryTracker("run-1", now=Clock())
    for _ in range(5):
        t.report("SLOW_STEP_NO_TIMEOUT", "info", "step 'fetch' took {seconds}s and has no timeout=", seconds=75)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines == [
        "durably advisory [INFO] SLOW_STEP_NO_TIMEOUT: step 'fetch' took 75s and has no timeout= "
        f"(hint: {CODES['SLOW_STEP_NO_TIMEOUT'].hint}; docs: {DOCS_DIR / 'advisories.md'}  "
        "(`durably docs advisories#slow_step_no_timeout` prints it))"  # the installed page, as errors say
    ]
    t.report("SLOW_STEP_NO_TIMEOUT", "warn", "took 400s")
    t.report("SLOW_STEP_NO_TIMEOUT", "warn", "took 500s")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("durably advisory [WARN] SLOW_STEP_NO_TIMEOUT: took 400s (hint: ")


def test_silent_mode_still_calls_back(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Advisory] = []
    t = AdvisoryTracker("run-1", now=Clock(), silent=True, on_advisory=seen.append)
    assert t.report("WAITFOR_NO_TIMEOUT", "info", "no timeout") is not None
    assert capsys.readouterr().err == ""
    assert len(seen) == 1


def test_broken_stream_is_ignored() -> None:
    stream = io.StringIO()
    stream.close()
    t = AdvisoryTracker("run-1", now=Clock(), stream=stream)
    assert t.report("WAITFOR_NO_TIMEOUT", "info", "no timeout") is not None


# --- callback -------------------------------------------------------------------------------------


def test_callback_raising_is_swallowed() -> None:
    calls: list[str] = []

    def boom(advisory: Advisory) -> None:
        calls.append(advisory.code)
        raise RuntimeError("listener bug")

    t, _, stream = tracker(on_advisory=boom)
    emitted = t.report("FANOUT_CEILING", "warn", "10000 branches")
    assert emitted is not None and calls == ["FANOUT_CEILING"]
    assert "FANOUT_CEILING" in stream.getvalue()


# --- restored advisories --------------------------------------------------------------------------


def test_restored_advisories_not_reemitted() -> None:
    restored = Advisory("LOOP_SUGGESTED", "info", "old", "h", "d", 7, T0)
    t, seen, stream = tracker(restored=[restored])
    assert t.report("LOOP_SUGGESTED", "info", "again") is None
    assert seen == [] and stream.getvalue() == ""
    assert t.active()[0].count == 8 and t.active()[0].first_at == T0
    assert restored.count == 7
    escalated = t.report("LOOP_SUGGESTED", "warn", "now 1000")
    assert escalated is not None and escalated.count == 9 and escalated.first_at == T0
    assert len(seen) == 1 and stream.getvalue().startswith("durably advisory [WARN] LOOP_SUGGESTED")


def test_restored_count_toward_cap() -> None:
    restored = [Advisory(f"OLD{i}", "info", "m", "h", "d", 1, T0) for i in range(10)]
    t, seen, _ = tracker(restored=restored)
    assert t.report("LOOP_SUGGESTED", "info", "x") is None
    assert len(t.active()) == 10 and seen == []


# --- formatting and check -------------------------------------------------------------------------


def test_message_and_hint_formatting() -> None:
    t, _, _ = tracker()
    a = t.report("CONCURRENCY_CAPPED", "info", CODES["CONCURRENCY_CAPPED"].message, children=40, concurrency=8)
    assert a is not None
    assert a.msg == "a fan-out of 40 children runs at most 8 at a time"
    assert "above 8" in a.hint and "40 children" in a.hint


def test_formatting_never_raises() -> None:
    t, _, _ = tracker()
    a = t.report("LOOP_SUGGESTED", "info", "{count} steps labelled {label!r} {0} {x:.2f}", count=5, x="str")
    assert a is not None and a.msg == "{count} steps labelled {label!r} {0} {x:.2f}"
    b = t.report("FANOUT_CEILING", "info", "{branches} branches of {name}", branches=1200)
    assert b is not None and b.msg == "1200 branches of {name}"
    c = t.report("BUDGET_NEAR", "info", "literal {braces} kept")
    assert c is not None and c.msg == "literal {braces} kept"


def test_check_uses_thresholds_and_catalogue_message() -> None:
    t, seen, _ = tracker()
    assert t.check("LOOP_SUGGESTED", 99, count=99, label="fetch") is None
    a = t.check("LOOP_SUGGESTED", 100, count=100, label="fetch")
    assert a is not None and a.level == "info"
    assert a.msg == "100 steps labelled 'fetch' ran one after another in one scope"
    assert t.check("LOOP_SUGGESTED", 500, count=500, label="fetch") is None
    w = t.check("LOOP_SUGGESTED", 1000, msg="custom {measure}")
    assert w is not None and w.level == "warn" and w.msg == "custom 1000"
    assert len(seen) == 2


# --- wire helpers ---------------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip() -> None:
    a = Advisory("BUDGET_NEAR", "warn", "96% of cost", CODES["BUDGET_NEAR"].hint, CODES["BUDGET_NEAR"].docs, 3, T0)
    wire = a.to_dict()
    assert wire["first_at"] == "2024-01-01T00:00:00+00:00"
    assert all(isinstance(v, str | int) for v in wire.values())
    assert Advisory.from_dict(wire) == a


def test_from_dict_defaults_and_errors() -> None:
    a = Advisory.from_dict({"code": "RETRY_STORM", "level": "info", "msg": "m", "first_at": "2024-01-01T00:00:00Z"})
    assert a.hint == CODES["RETRY_STORM"].hint and a.docs == CODES["RETRY_STORM"].docs and a.count == 1
    assert a.first_at == T0
    future = Advisory.from_dict({"code": "FUTURE_CODE", "level": "warn", "msg": "m", "first_at": "2024-01-01T00:00:00+00:00"})
    assert future.code == "FUTURE_CODE"
    for bad in ({"level": "info", "first_at": "2024-01-01"}, {"code": "X", "level": "loud", "first_at": "2024-01-01"},
                {"code": "X", "level": "info", "first_at": "yesterday"}):
        with pytest.raises(ValidationError):
            Advisory.from_dict(bad)
