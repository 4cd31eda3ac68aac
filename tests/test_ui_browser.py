"""The web console in headless Chromium: real `durably ui` and `durably run` processes, a real browser.

Debian's Chromium (`apt-get install chromium`, as .ci/run does) is driven by Playwright through
`executable_path`; no browser is downloaded. Set DURABLY_UI_SCREENSHOTS=docs/img to refresh the
screenshots docs/ui.md shows (otherwise they go to a temporary directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

pytest.importorskip("starlette")
playwright_api = pytest.importorskip("playwright.sync_api")

FLOWS = Path(__file__).parent / "ui_flows.py"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "durably_py.cli", *args]


def run_flow(state: Path, workflow: str, input: Any, *extra: str) -> subprocess.Popen[str]:
    """Start `durably run tests/ui_flows.py --workflow WORKFLOW` in its own process."""
    return subprocess.Popen(cli("run", str(FLOWS), "--workflow", workflow, "--input", json.dumps(input),
                                "--dir", str(state), *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with a parallel run with retries, a task graph with its child runs, a failed run, and a run of
    parallel branches of several steps each."""
    state = tmp_path_factory.mktemp("browser") / ".durably"
    started = [run_flow(state, workflow, input, *extra)  # side by side: they share nothing but the store
               for workflow, input, extra in (("checkout", 129.9, ("--key", "order-7731")), ("pipeline", None, ()),
                                              ("fanout", 9, ("--key", "crawl-2026-05")),
                                              ("approval", 75, ("--key", "expense-11", "--no-wait")),
                                              ("nested", 2, ("--key", "legs-2")))]
    for proc in started:
        proc.communicate(timeout=60)
    return state


@pytest.fixture(scope="module")
def server(state: Path) -> Iterator[str]:
    """`durably ui` over the store, in its own process; yields its URL."""
    proc = subprocess.Popen(cli("ui", "--dir", str(state), "--port", "0"), stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    found = re.search(r"http://\S+", line)
    assert found, f"durably ui printed {line!r}"
    yield found.group(0).rstrip("/")
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    if CHROMIUM is None:
        reason = "Chromium is not installed (apt-get install chromium); the console's browser tests did not run"
        warnings.warn(reason, stacklevel=1)
        print(f"\nSKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"durably-ui-chromium-{os.getpid()}"
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=FLAGS,
                                                       headless=True, viewport={"width": 1280, "height": 800})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    refusal = re.compile(r"status of (400|409) ")  # an operation the server refused, shown with its hint

    def console(msg: Any) -> None:
        if msg.type == "error" and not refusal.search(msg.text):
            errors.append(msg.text)
    page.on("console", console)
    yield page
    page.close()
    assert not errors, errors


def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("DURABLY_UI_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def wait_for_status(page: Any, status: str, timeout: float = 20) -> None:
    page.wait_for_selector(f".runhead .badge[data-status='{status}']", timeout=timeout * 1000)


def exists(state: Path, key: str, status: str | None = None) -> bool:
    done = subprocess.run(cli("list", "--key", key, "--json", "--dir", str(state)), capture_output=True, text=True)
    runs = json.loads(done.stdout or "[]")
    return bool(runs) and (status is None or runs[0]["status"] == status)


def fits(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"))


def test_run_page_shows_the_waterfall_of_a_parallel_run_with_retries(page: Any, server: str, tmp_path: Path) -> None:
    page.goto(f"{server}/runs/crawl-2026-05")
    wait_for_status(page, "completed")
    rows = page.locator(".wf-row")
    assert rows.count() == 11  # nine fetches, the sleep, the total
    retried = page.locator(".wf-row[data-path='1']")
    assert retried.locator(".bar.k-attempt.st-failed").count() == 2
    assert retried.locator(".bar.k-backoff").count() == 2
    assert page.locator(".wf-row[data-path='9'] .bar.k-sleep").count() == 1
    retried.click()
    assert page.locator(".detail h2").inner_text() == "fetch 1"
    assert "ConnectionError" in page.locator(".detail").inner_text()
    page.screenshot(path=str(shots(tmp_path) / "ui-run.png"))
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=str(shots(tmp_path) / "ui-run-dark.png"))
    page.set_viewport_size({"width": 390, "height": 800})
    assert fits(page)


def test_step_tree_folds_and_unfolds_branches_from_the_keyboard(page: Any, server: str) -> None:
    page.goto(f"{server}/runs/legs-2")
    wait_for_status(page, "completed")
    rows = page.locator(".wf-row")
    paths = ["0", "0.0", "0.0.0", "0.0.1", "0.1", "0.1.0", "0.1.1", "1"]
    playwright_api.expect(rows).to_have_count(len(paths))
    assert [rows.nth(i).get_attribute("data-path") for i in range(len(paths))] == paths
    assert "2 branches" in page.locator(".wf-row[data-path='0']").inner_text()
    branch = page.locator(".wf-row[data-path='0.0'] .twisty")
    branch.focus()
    page.keyboard.press("Enter")
    playwright_api.expect(rows).to_have_count(6)
    assert page.locator(".wf-row[data-path='0.0.0']").count() == 0
    assert page.locator(".wf-row[data-path='0.1.1']").count() == 1
    playwright_api.expect(page.locator(".wf-row[data-path='0.0']")).to_have_attribute("aria-expanded", "false")
    page.keyboard.press("ArrowRight")  # focus stays on the redrawn row's toggle
    playwright_api.expect(rows).to_have_count(8)
    page.locator(".wf-row[data-path='0'] .twisty").click()
    playwright_api.expect(rows).to_have_count(2)
    assert [rows.nth(i).get_attribute("data-path") for i in range(2)] == ["0", "1"]


def test_graph_links_to_child_runs(page: Any, server: str, state: Path, tmp_path: Path) -> None:
    page.goto(f"{server}/")
    page.locator("tr[data-run] a", has_text="pipeline-").click()
    wait_for_status(page, "completed")
    nodes = page.locator(".graph .node")
    assert nodes.count() == 5
    assert page.locator(".graph .node.s-completed").count() == 5
    assert page.locator(".wf-row[data-path='0.0.0'] .bar.k-child").count() == 1  # the child run's lifetime
    page.screenshot(path=str(shots(tmp_path) / "ui-graph.png"), full_page=True)
    page.locator(".graph a", has=page.locator("[data-node='train']")).click()
    wait_for_status(page, "completed")
    assert page.locator(".runhead h1").inner_text() == "stage"
    assert "parent run" in page.locator(".facts").inner_text()


def test_follows_a_live_run_to_completion(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "slow", {"n": 10, "delay": 0.3}, "--key", "live-1")
    try:
        wait_until(lambda: exists(state, "live-1"), every=0.1)
        page.goto(f"{server}/runs/live-1")
        wait_for_status(page, "running")
        seen = page.locator(".wf-row").count()
        assert seen < 10
        wait_for_status(page, "completed", timeout=30)
        assert page.locator(".wf-row").count() == 10  # the rows arrived live, with no reload
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_signal_through_the_form_completes_the_waiting_run(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "approval", 420, "--key", "expense-12")
    try:
        wait_until(lambda: exists(state, "expense-12", "waiting"), every=0.1)
        page.goto(f"{server}/runs/expense-12")
        wait_for_status(page, "waiting")
        page.click("button[data-op='signal']")
        dialog = page.locator("dialog[open]")
        assert dialog.locator("input[name='name']").input_value() == "approval"  # the signal the run waits for
        dialog.locator("textarea").fill('{"ok": true, "by": ')
        assert "not valid JSON" in dialog.locator(".invalid").inner_text()
        assert dialog.locator("button[data-confirm]").is_disabled()
        dialog.locator("textarea").fill('{"ok": true, "by": "ana"}')
        dialog.locator("button[data-confirm]").click()
        page.wait_for_selector("[data-result='signal']")
        wait_for_status(page, "completed", timeout=30)
        assert "paid 420.00, approved by ana" in proc.communicate(timeout=30)[0]
    finally:
        proc.kill()


def test_cancel_a_running_run(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "slow", {"n": 60, "delay": 0.2}, "--key", "batch-99")
    try:
        wait_until(lambda: exists(state, "batch-99", "running"), every=0.1)
        page.goto(f"{server}/runs/batch-99")
        wait_for_status(page, "running")
        page.click("button[data-op='cancel']")
        page.locator("dialog[open] button[data-confirm]").click()
        page.wait_for_selector("[data-result='cancel']", timeout=20000)
        wait_for_status(page, "cancelled")
        assert proc.wait(timeout=20) != 0
        page.click("button[data-op='retry']")
        page.locator("dialog[open] button[data-confirm]").click()
        failure = page.wait_for_selector("[data-result='retry-failed']")
        assert "restart" in failure.inner_text()  # the refusal shows its hint
    finally:
        proc.kill()


def test_runs_page_filters_and_searches(page: Any, server: str, tmp_path: Path) -> None:
    page.goto(f"{server}/")
    page.wait_for_selector("tr[data-run]")
    assert page.locator("tr[data-run]").count() >= 8
    page.screenshot(path=str(shots(tmp_path) / "ui-runs.png"))
    page.select_option("select[name='status']", "failed")
    playwright_api.expect(page.locator("tr[data-run]")).to_have_count(1)
    assert "order-7731" in page.locator("tr[data-run]").inner_text()
    assert "status=failed" in page.url
    page.select_option("select[name='status']", "")
    page.fill("input[name='q']", "crawl")
    playwright_api.expect(page.locator("tr[data-run]")).to_have_count(1)
    assert "fanout" in page.locator("tr[data-run]").inner_text()
    page.fill("input[name='q']", "")
    page.fill("input[name='workflow']", "stage")
    playwright_api.expect(page.locator("tr[data-run]")).to_have_count(5)
    playwright_api.expect(page.locator(".heading > span.muted")).to_have_text("runs 1–5 of 5 (last page)")
    page.set_viewport_size({"width": 390, "height": 800})
    assert fits(page)


# ---- every record kind, every wait explained ------------------------------------------------------------------


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """`durably ui` over a store holding a record of every kind (log_kinds.py); its URL, folder and run ids."""
    from log_kinds import make_every_kind

    project = tmp_path_factory.mktemp("kinds")
    runs = make_every_kind(project)
    proc = subprocess.Popen(cli("ui", "--dir", str(project / ".durably"), "--port", "0"), stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    found = re.search(r"http://\S+", proc.stderr.readline())
    assert found
    yield found.group(0).rstrip("/"), project, runs
    proc.terminate()
    proc.wait(timeout=10)


def log_kinds_of(page: Any, url: str, run_id: str) -> set[str]:
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector(".runhead .badge")
    page.locator("details[data-log] summary").click()
    page.wait_for_selector("ol.log li")
    return {page.locator("ol.log li").nth(i).get_attribute("data-kind") for i in range(page.locator("ol.log li").count())}


def test_the_log_panel_reads_every_record_kind(page: Any, kinds: tuple[str, Path, dict[str, str]]) -> None:
    from durably_py import records

    url, project, runs = kinds
    seen: set[str] = set()
    for run_id in runs.values():
        seen |= log_kinds_of(page, url, run_id)
        assert "Traceback" not in page.locator("ol.log").inner_text()
    assert seen >= set(records.KINDS), set(records.KINDS) - seen
    log_kinds_of(page, url, runs["everything"])
    text = page.locator("ol.log").inner_text()
    assert "charged $0.25, 10 tokens" in text and "ctx.patched('v2') takes the new code" in text


def test_loop_iterations_steps_and_ctx_calls_are_told_apart(page: Any, kinds: tuple[str, Path, dict[str, str]]) -> None:
    url, _, runs = kinds
    page.goto(f"{url}/runs/{runs['everything']}")
    page.wait_for_selector(".wf-row[data-path='4.1']")
    assert "iteration 0" in page.locator(".wf-row[data-path='4.0']").inner_text()
    assert "iteration 1" in page.locator(".wf-row[data-path='4.1']").inner_text()
    assert "branch 0" in page.locator(".wf-row[data-path='3.0']").inner_text()  # a graph's branches stay branches
    facts = page.locator(".facts").inner_text()
    shown = durably_inspect(runs["everything"], project=kinds[1])
    own = re.search(r"steps \((\d+)", shown)
    assert own and f"steps done\n{own.group(1)} of {own.group(1)} · " in facts, (facts, shown)


def durably_inspect(run_id: str, *, project: Path) -> str:
    done = subprocess.run(cli("inspect", run_id), cwd=project, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_unread_signals_and_a_ready_run_are_shown(page: Any, kinds: tuple[str, Path, dict[str, str]]) -> None:
    url, project, runs = kinds
    run_id = runs["renamed"]  # waits for "later", no process holds it
    for name in ("sooner", "later"):
        subprocess.run(cli("signal", run_id, name, '{"n": 1}'), cwd=project, check=True, capture_output=True)
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector("[data-ready]")
    assert "ready: signal 'later' received; a worker or durably retry" in page.locator("[data-ready]").inner_text()
    signals = page.locator("[data-signals] [data-signal]")
    assert [signals.nth(i).get_attribute("data-signal") for i in range(signals.count())] == ["sooner", "later"]
    assert 'payload {"n":1}' in page.locator("[data-signal='sooner']").inner_text()
    page.locator("details[data-log] summary").click()
    page.wait_for_selector("ol.log li[data-kind='signal']")
    assert page.locator("ol.log li[data-kind='signal']").count() == 2


def test_a_running_step_shows_its_time_and_the_process_holding_it(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "slow", {"n": 1, "delay": 8}, "--key", "long-1")
    try:
        wait_until(lambda: exists(state, "long-1", "running"), every=0.1)
        page.goto(f"{server}/runs/long-1")
        wait_for_status(page, "running")
        page.wait_for_selector(".wf-row[data-path='0'] [data-elapsed]", timeout=15000)  # its start is recorded
        first = page.locator(".wf-row[data-path='0'] [data-elapsed]").inner_text()
        assert re.fullmatch(r"\d+\.\d+ s", first), first
        assert f"running in\npid {proc.pid} on " in page.locator(".facts").inner_text()
        page.locator(".wf-row[data-path='0']").click()
        assert re.fullmatch(r"\d+\.\d+ s", page.locator("[data-running-for]").inner_text())
    finally:
        proc.kill()
        proc.wait()


def test_a_streaming_step_shows_its_live_output(page: Any, server: str, state: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    proc = run_flow(state, "chatter", {"n": 3, "gate": str(gate)}, "--key", "chat-1")
    try:
        wait_until(lambda: exists(state, "chat-1", "running"), every=0.1)
        page.goto(f"{server}/runs/chat-1")
        wait_for_status(page, "running")
        page.wait_for_selector(".wf-row[data-path='0'] [data-elapsed]", timeout=15000)
        page.locator(".wf-row[data-path='0']").click()
        page.wait_for_function("() => (document.querySelector('[data-live-output]') || {}).textContent"
                               " === 'word0 word1 word2 '", timeout=15000)
        gate.touch()
        wait_for_status(page, "completed")
    finally:
        gate.touch()
        proc.communicate(timeout=60)


def test_a_pending_run_says_a_worker_runs_it_and_a_parked_run_stops_its_clock(page: Any, server: str,
                                                                              state: Path) -> None:
    done = subprocess.run(cli("enqueue", str(FLOWS), "-w", "slow", "-i", '{"n": 1, "delay": 0}', "--priority", "3",
                              "--delay", "1h", "--dir", str(state)), capture_output=True, text=True, check=True)
    run_id = done.stdout.strip()
    page.goto(f"{server}/runs/{run_id}")
    wait_for_status(page, "pending")
    assert "nothing runs it until a worker claims it" in page.locator("[data-pending]").inner_text()
    facts = page.locator(".facts").inner_text()
    assert "priority\n3" in facts and "due\n" in facts
    page.goto(f"{server}/runs/expense-11")  # parked since the module began: its clock stopped then
    wait_for_status(page, "waiting")
    duration = page.locator(".facts").inner_text().split("duration\n", 1)[1].split("\n", 1)[0]
    assert duration.endswith("ms") or float(duration.split()[0]) < 2, duration
    page.goto(f"{server}/?q=expense-11")
    row = page.locator("tr[data-run]", has_text="expense-11")
    playwright_api.expect(row).to_have_count(1)
    cell = row.locator("td").nth(5).inner_text()
    assert cell.endswith("ms") or float(cell.split()[0]) < 2, cell


def test_the_queues_page_shows_each_queue_and_its_runs(page: Any, server: str) -> None:
    page.goto(f"{server}/")
    page.click("header nav a[href='/queues']")
    page.wait_for_selector("tr[data-queue='default']", timeout=20_000)
    shown = [c.strip() for c in page.inner_text("tr[data-queue='default']").split("\t")]
    default = next(q for q in page.evaluate("fetch('/api/queues').then(r => r.json())") if q["name"] == "default")
    assert shown[:5] == ["default", *(str(default[k]) for k in ("due", "later", "running", "parked"))]
    assert page.title() == "Queues · durably"
