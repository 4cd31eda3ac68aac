"""Approval forms and effect resolution in headless Chromium: real `durably ui` and `durably run` processes.

A run waiting in `ctx.wait_for(name, schema=...)` shows a form built from the recorded JSON Schema; a value the
server refuses shows its error and changes nothing; a right one completes the run. A bool wait shows approve and
deny. A run whose unsafe step was cut off by SIGKILL (`needs_attention`) is resolved with each of the three
buttons, through its confirmation, and ends as that decision says.
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

FLOWS = Path(__file__).parent / "form_flows.py"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "durably_py.cli", *args]


def run_flow(state: Path, workflow: str, input: Any, *extra: str) -> subprocess.Popen[str]:
    """Start `durably run tests/form_flows.py --workflow WORKFLOW` in its own process."""
    return subprocess.Popen(cli("run", str(FLOWS), "--workflow", workflow, "--input", json.dumps(input),
                                "--dir", str(state), *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listed(state: Path, key: str) -> dict[str, Any] | None:
    done = subprocess.run(cli("list", "--key", key, "--json", "--dir", str(state)), capture_output=True, text=True)
    runs = json.loads(done.stdout or "[]")
    return runs[0] if runs else None


def status_of(state: Path, key: str) -> str | None:
    found = listed(state, key)
    return None if found is None else str(found["status"])


def log_kinds(state: Path, run_id: str) -> list[str]:
    """The kinds of the run's records, then of its unread signals (`durably logs -o jsonl` prints both)."""
    done = subprocess.run(cli("logs", run_id, "-o", "jsonl", "--dir", str(state)), capture_output=True, text=True,
                          check=True)
    return [json.loads(line)["t"] for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("forms") / ".durably"


@pytest.fixture(scope="module")
def server(state: Path) -> Iterator[str]:
    """`durably ui` over the store, in its own process; yields its URL."""
    state.mkdir(parents=True, exist_ok=True)
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
        reason = "Chromium is not installed (apt-get install chromium); the console's form tests did not run"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"durably-forms-chromium-{os.getpid()}"
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=FLAGS,
                                                       headless=True, viewport={"width": 1280, "height": 900})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    refusal = re.compile(r"status of (400|409) ")  # a value the server refused, shown in the form

    def console(msg: Any) -> None:
        if msg.type == "error" and not refusal.search(msg.text):
            errors.append(msg.text)
    page.on("console", console)
    yield page
    page.close()
    assert not errors, errors


def wait_for_status(page: Any, status: str, timeout: float = 30) -> None:
    page.wait_for_selector(f".runhead .badge[data-status='{status}']", timeout=timeout * 1000)


def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("DURABLY_UI_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


# ---- approval forms ---------------------------------------------------------------------------------------


def test_a_struct_wait_is_a_form_the_server_checks(page: Any, server: str, state: Path, tmp_path: Path) -> None:
    proc = run_flow(state, "expense_form", "ana", "--key", "expense-form-1")
    try:
        wait_until(lambda: status_of(state, "expense-form-1") == "waiting", every=0.1, seconds=60)
        run_id = str(listed(state, "expense-form-1")["run_id"])  # type: ignore[index]
        page.goto(f"{server}/runs/expense-form-1")
        wait_for_status(page, "waiting")
        form = page.locator("[data-form='expense']")
        playwright_api.expect(form).to_be_visible()
        assert form.locator("input[data-field='amount']").get_attribute("type") == "number"
        assert form.locator("input[data-field='reason']").get_attribute("type") == "text"
        assert form.locator("input[data-field='urgent']").get_attribute("type") == "checkbox"
        level = form.locator("select[data-field='level']")
        assert level.locator("option").all_inner_texts() == ["high", "low"] and level.input_value() == '"low"'
        assert "≥ 1, ≤ 10000" in form.locator("[data-field-box='amount']").inner_text()
        before = log_kinds(state, run_id)

        form.locator("input[data-field='amount']").fill("0")  # the form sends it; the server refuses it
        form.locator("input[data-field='reason']").fill("taxi")
        form.locator("button[data-op='submit']").click()
        refused = form.locator("[data-result='submit-failed']")
        playwright_api.expect(refused).to_contain_text("invalid value at $.amount: expected a number >= 1, got 0")
        assert "Correct field 'amount'" in refused.inner_text()
        playwright_api.expect(form.locator("input[data-field='amount']")).to_have_attribute("aria-invalid", "true")
        playwright_api.expect(form.locator("button[data-op='submit']")).to_be_enabled()
        page.mouse.move(0, 0)
        page.screenshot(path=str(shots(tmp_path) / "ui-form.png"))
        assert log_kinds(state, run_id) == before and "signal" not in before  # nothing recorded, nothing sent
        assert status_of(state, "expense-form-1") == "waiting"
        assert page.locator("[data-signals]").count() == 0

        form.locator("input[data-field='amount']").fill("12")
        level.select_option('"high"')
        form.locator("input[data-field='urgent']").check()
        form.locator("button[data-op='submit']").click()
        page.wait_for_selector("[data-result='submit']")
        wait_for_status(page, "completed")
        assert page.locator("[data-form]").count() == 0
        assert "ana: 12 for taxi (high, urgent)" in proc.communicate(timeout=30)[0]
        assert status_of(state, "expense-form-1") == "completed"
    finally:
        proc.kill()
        proc.wait()


def test_a_bool_wait_shows_approve_and_deny(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "go_no_go", None, "--key", "go-1")
    free = run_flow(state, "free_form", None, "--key", "free-1")
    try:
        wait_until(lambda: status_of(state, "go-1") == "waiting", every=0.1, seconds=60)
        page.goto(f"{server}/runs/go-1")
        wait_for_status(page, "waiting")
        form = page.locator("[data-form='go']")
        playwright_api.expect(form.locator("button[data-op='approve']")).to_be_visible()
        playwright_api.expect(form.locator("button[data-op='deny']")).to_be_visible()
        assert form.locator("input, textarea, select").count() == 0
        form.locator("button[data-op='approve']").click()
        dialog = page.locator("dialog[open]")
        assert "Approve" in dialog.locator("h2").inner_text()
        dialog.locator("button[data-confirm]").click()
        page.wait_for_selector("[data-result='submit']")
        wait_for_status(page, "completed")
        assert "approved" in proc.communicate(timeout=30)[0]

        wait_until(lambda: status_of(state, "free-1") == "waiting", every=0.1, seconds=60)
        page.goto(f"{server}/runs/free-1")  # no schema recorded: a JSON textarea takes any value
        wait_for_status(page, "waiting")
        box = page.locator("[data-form='data'] textarea[data-field='value']")
        box.fill('{"rows": [1, 2')
        page.locator("[data-form='data'] button[data-op='submit']").click()
        playwright_api.expect(page.locator("[data-result='submit-invalid']")).to_contain_text("is not valid JSON")
        box.fill('{"rows": [1, 2]}')
        page.locator("[data-form='data'] button[data-op='submit']").click()
        wait_for_status(page, "completed")
        assert json.loads(free.communicate(timeout=30)[0]) == {"rows": [1, 2]}
    finally:
        for p in (proc, free):
            p.kill()
            p.wait()


# ---- effects that need attention: the three decisions ------------------------------------------------------


def cut_off(state: Path, folder: Path, order: str) -> str:
    """A real `durably run` SIGKILLed inside its unsafe charge; the key of its run (needs_attention)."""
    proc = run_flow(state, "unsafe_charge", {"dir": str(folder), "order": order}, "--key", f"pay-{order}")
    try:
        wait_until(lambda: (folder / f"charging-{order}").exists() or proc.poll() is not None, seconds=60)
        assert proc.poll() is None, proc.communicate()[1]
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    wait_until(lambda: status_of(state, f"pay-{order}") == "needs_attention", seconds=30, every=0.1)
    return f"pay-{order}"


def effects(folder: Path) -> list[str]:
    log = folder / "effects.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def cut(state: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """Three runs cut off inside their unsafe step, one per decision: key and effects folder of each."""
    out = {}
    for order in ("value", "rerun", "fail"):
        folder = tmp_path_factory.mktemp(f"effects-{order}")
        out[order] = (cut_off(state, folder, order), folder)
    return out


def open_attention(page: Any, server: str, key: str) -> Any:
    page.goto(f"{server}/runs/{key}")
    wait_for_status(page, "needs_attention")
    effect = page.locator("[data-attention] [data-effect='1']")
    playwright_api.expect(effect).to_be_visible()
    return effect


def test_resolve_with_a_verified_value(page: Any, server: str, state: Path, cut: dict[str, tuple[str, Path]]) -> None:
    key, folder = cut["value"]
    effect = open_attention(page, server, key)
    assert effect.locator("[data-operation-id]").inner_text().endswith("/1")
    effect.locator("button[data-op='resolve-value']").click()
    dialog = page.locator("dialog[open]")
    dialog.locator("textarea[name='value']").fill('{"charged": "verified by hand"')
    assert "not valid JSON" in dialog.locator(".invalid").inner_text()
    dialog.locator("textarea[name='value']").fill('{"charged": "verified by hand"}')
    dialog.locator("button[data-confirm]").click()
    page.wait_for_selector("[data-result='resolve']")
    wait_for_status(page, "completed")
    assert listed(state, key)["result"] == {"charged": "verified by hand"}  # type: ignore[index]
    assert effects(folder) == ["book value", "charge value"]  # the charge did not run again


def test_resolve_by_running_the_step_again(page: Any, server: str, state: Path,
                                           cut: dict[str, tuple[str, Path]]) -> None:
    key, folder = cut["rerun"]
    effect = open_attention(page, server, key)
    effect.locator("button[data-op='resolve-rerun']").click()
    dialog = page.locator("dialog[open]")
    assert "again" in dialog.locator("h2").inner_text()
    dialog.locator("button[data-confirm]").click()
    page.wait_for_selector("[data-result='resolve']")
    wait_for_status(page, "completed")
    assert listed(state, key)["result"] == {"charged": "rerun"}  # type: ignore[index]
    assert effects(folder) == ["book rerun", "charge rerun", "charge rerun"]


def test_resolve_by_failing_the_step(page: Any, server: str, state: Path, cut: dict[str, tuple[str, Path]]) -> None:
    key, folder = cut["fail"]
    effect = open_attention(page, server, key)
    effect.locator("button[data-op='resolve-fail']").click()
    dialog = page.locator("dialog[open]")
    dialog.locator("button", has_text="Close").click()  # closing the confirmation decides nothing
    assert status_of(state, key) == "needs_attention"
    effect.locator("button[data-op='resolve-fail']").click()
    page.locator("dialog[open] button[data-confirm]").click()
    wait_for_status(page, "failed")
    assert "EffectFailedError" in page.locator(".runhead").locator("xpath=..").inner_text()
    assert status_of(state, key) == "failed"
    wait_until(lambda: "unbook fail" in effects(folder), seconds=30)  # the failed run's compensation ran
    assert effects(folder) == ["book fail", "charge fail", "unbook fail"]


def test_an_awakeable_with_a_schema_is_a_form_too(page: Any, server: str, state: Path) -> None:
    proc = run_flow(state, "expense_awakeable", "bo", "--key", "expense-awakeable-1")
    try:
        wait_until(lambda: status_of(state, "expense-awakeable-1") == "waiting", every=0.1, seconds=60)
        run_id = str(listed(state, "expense-awakeable-1")["run_id"])  # type: ignore[index]
        page.goto(f"{server}/runs/expense-awakeable-1")
        wait_for_status(page, "waiting")
        form = page.locator(f"[data-form='{run_id}:0']")
        playwright_api.expect(form).to_be_visible()
        assert f'ctx.awakeable("expense") {run_id}:0' in form.inner_text()
        before = log_kinds(state, run_id)
        form.locator("input[data-field='amount']").fill("0")
        form.locator("input[data-field='reason']").fill("taxi")
        form.locator("button[data-op='submit']").click()
        refused = form.locator("[data-result='submit-failed']")
        playwright_api.expect(refused).to_contain_text("invalid value at $.amount: expected a number >= 1, got 0")
        playwright_api.expect(form.locator("input[data-field='amount']")).to_have_attribute("aria-invalid", "true")
        assert log_kinds(state, run_id) == before  # nothing recorded, nothing sent
        form.locator("input[data-field='amount']").fill("12")
        form.locator("button[data-op='submit']").click()
        wait_for_status(page, "completed")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "bo: 12 for taxi" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
