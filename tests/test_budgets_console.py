"""The console's budget panel in headless Chromium: a run parked over budget shows what it spent and on what,
and its *Raise budget* button lets it finish (real `durably ui` and script processes, a real browser)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("starlette")
playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")]

AGENT = textwrap.dedent('''
    import sys
    from durably_py import RunParkedError, run, workflow

    def model(i):
        return {"usage": {"input_tokens": 800, "output_tokens": 200}, "text": f"t{i}"}

    @workflow
    async def agent(ctx, n):
        return [(await ctx.step(model, i, name="model"))["text"] for i in range(n)]

    if __name__ == "__main__":
        try:
            print(run(agent, 5, budget={"tokens": 2500}, dir=sys.argv[1], wait=False))
        except RunParkedError as parked:
            print(parked.run_id)
''')


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "durably_py.cli", *args]


@pytest.fixture
def parked(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "agent.py").write_text(AGENT)
    state = tmp_path / ".durably"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(tmp_path / "agent.py"), str(state)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)
    return state, done.stdout.split()[-1]


def test_the_raise_button_lets_an_over_budget_run_finish(parked: tuple[Path, str]) -> None:
    state, run_id = parked
    proc = subprocess.Popen(cli("ui", "--dir", str(state), "--port", "0"), stderr=subprocess.PIPE, text=True)
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"durably-budget-chromium-{os.getpid()}"
    try:
        assert proc.stderr is not None
        found = re.search(r"http://\S+", proc.stderr.readline())
        assert found
        server = found.group(0).rstrip("/")
        with playwright_api.sync_playwright() as p:
            context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=FLAGS,
                                                           headless=True, viewport={"width": 1280, "height": 800})
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server}/runs/{run_id}")
            page.wait_for_selector(".runhead .badge[data-status='over_budget']", timeout=20_000)
            panel = page.locator("[data-over-budget]")
            assert "3000 tokens of 2500 tokens" in panel.inner_text()
            assert "3000 tokens" in panel.locator("[data-spent-on='model']").inner_text()
            panel.locator("input[name='amount']").fill("5000")
            panel.locator("button[data-op='budget-raise']").click()
            page.wait_for_selector("[data-result='budget']", timeout=20_000)
            page.wait_for_selector(".runhead .badge[data-status='completed']", timeout=30_000)
            context.close()
            assert not errors, errors
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
    shown = json.loads(subprocess.run(cli("budget", run_id, "--json", "--dir", str(state)), capture_output=True,
                                      text=True).stdout)
    assert shown["status"] == "completed" and shown["budget"] == {"tokens": 7500.0}
    assert shown["spent"] == {"tokens": 5000.0}
