"""OpenTelemetry export through the global tracer provider, checked with the SDK's in-memory exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")

SCRIPT = textwrap.dedent('''
    import json, sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from durably_py import Retry, attempt, run, workflow

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    broken = {"c": True}

    def a(x):
        return x + 1

    def b(x):
        if attempt().number == 1:
            raise ConnectionError("first try fails")
        return x * 2

    def c(x):
        if broken["c"]:
            raise ValueError("c is broken")
        return x

    @workflow
    async def traced(ctx, n):
        x = await ctx.step(a, n)
        y = await ctx.step(b, x, retry=Retry(2, base=0.01))
        return await ctx.step(c, y)

    def dump(tag):
        out = []
        for s in exporter.get_finished_spans():
            out.append({"name": s.name, "attrs": dict(s.attributes), "id": s.context.span_id,
                        "parent": s.parent.span_id if s.parent else None, "error": s.status.status_code.name})
        print(tag, json.dumps(out))
        exporter.clear()

    try:
        run(traced, 1, dir=sys.argv[1])
    except ValueError:
        pass
    dump("FIRST")
    broken["c"] = False
    print("RESULT", run(traced, 1, dir=sys.argv[1]))
    dump("SECOND")
''')


def traced(tmp_path: Path, **env: str) -> dict[str, list[dict]]:
    script = tmp_path / "traced.py"
    script.write_text(SCRIPT)
    full = {k: v for k, v in os.environ.items() if k != "DURABLY_OTEL"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=60, env={**full, **env})
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["RESULT"] == "4"
    return {tag: json.loads(lines[tag]) for tag in ("FIRST", "SECOND")}


def test_spans_per_run_and_step_attempt_and_replayed_steps_are_not_exported_again(tmp_path: Path) -> None:
    spans = traced(tmp_path)
    first = spans["FIRST"]
    run_span = next(s for s in first if s["name"] == "durably run traced")
    run_id = run_span["attrs"]["durably.run_id"]
    assert run_span["attrs"] == {"durably.run_id": run_id, "durably.workflow": "traced", "durably.status": "failed"}
    assert run_span["parent"] is None and run_span["error"] == "ERROR"
    steps = [(s["attrs"]["durably.step.path"], s["attrs"]["durably.step.label"], s["attrs"]["durably.step.attempt"],
              s["attrs"]["durably.status"]) for s in first if s is not run_span]
    assert steps == [("0", "a", 1, "ok"), ("1", "b", 1, "retrying"), ("1", "b", 2, "ok"), ("2", "c", 1, "failed")]
    for s in first:
        if s is not run_span:
            assert s["parent"] == run_span["id"] and s["attrs"]["durably.run_id"] == run_id
            assert s["attrs"]["durably.workflow"] == "traced"
    assert [s["error"] for s in first if s is not run_span] == ["UNSET", "ERROR", "UNSET", "ERROR"]

    second = spans["SECOND"]
    assert sorted(s["name"] for s in second) == ["c", "durably run traced"]  # a and b replayed: not exported
    resumed = next(s for s in second if s["name"] == "durably run traced")
    assert resumed["attrs"] == {"durably.run_id": run_id, "durably.workflow": "traced", "durably.status": "completed"}


def test_durably_otel_0_turns_export_off(tmp_path: Path) -> None:
    assert traced(tmp_path, DURABLY_OTEL="0") == {"FIRST": [], "SECOND": []}


def test_no_tracer_provider_means_no_span_hook_in_the_run(tmp_path: Path) -> None:
    code = textwrap.dedent('''
        import sys
        from durably_py import run, workflow
        from durably_py._engine import hooks as engine
        from durably_py._engine.otel import OtelHook

        @workflow
        async def plain(ctx, n):
            return n

        assert run(plain, 1, dir=sys.argv[1]) == 1
        installed = [h for h in engine._added_hooks if isinstance(h, OtelHook)]
        print(len(installed), len(engine.run_hooks()))
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())
        print(len(engine.run_hooks()))
    ''')
    full = {k: v for k, v in os.environ.items() if k != "DURABLY_OTEL"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state")], capture_output=True, text=True,
                          timeout=60, env=full)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0", "1"]
