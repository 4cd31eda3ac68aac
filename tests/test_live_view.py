"""The live view of `durably run` on a real pseudo-terminal: whatever the workflow prints (print, logging,
warnings, ctx.log, sys.stderr, bytes on sys.stdout.buffer, a subprocess's output, os.write on the descriptors;
from steps, threads and the event loop) reaches the terminal whole, once, above the view, with no stray warning;
the command never hangs; Ctrl-C and SIGTERM act within a second however busy the view is; and the README's first
command shows a clean view."""

from __future__ import annotations

import re
import signal
import statistics
import textwrap
import time
from pathlib import Path

import pytest
from helpers import durably
from terminal import ANSI, Terminal, interrupt

ROOT = Path(__file__).resolve().parent.parent

NOISY = textwrap.dedent('''
    import asyncio, logging, os, subprocess, sys, threading, time, warnings
    from durably_py import run, workflow

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("noisy")

    def noisy_step(i):
        for k in range(12):
            print(f"step-line {i}.{k}")
            log.info("logged %s.%s", i, k)
            sys.stderr.write(f"stderr {i}.{k}\\n")
        sys.stdout.write(f"part-")
        sys.stdout.flush()
        sys.stdout.write(f"ial {i}\\n")
        sys.stdout.buffer.write(f"bytes {i}\\n".encode())
        subprocess.run(["echo", f"subprocess {i}"], check=True)  # straight to the descriptors, not through Python
        os.write(2, f"descriptor {i}\\n".encode())
        warnings.warn(f"careful {i}")
        return i

    async def async_noisy(i):
        for k in range(8):
            print(f"async {i}.{k}", flush=True)
            await asyncio.sleep(0)
        return i

    def chatter(stop, said):
        n = 0
        while not stop.is_set() or n < 5:
            print(f"chatter {n}")
            n += 1
            time.sleep(0.002)
        said.append(n)

    @workflow
    async def noisy(ctx, rounds):
        stop, said = threading.Event(), []
        thread = threading.Thread(target=chatter, args=(stop, said))
        thread.start()
        try:
            for r in range(rounds):
                ctx.log(f"loop {r}")
                await ctx.parallel([ctx.step(noisy_step, r * 10 + j, name="noisy") for j in range(4)])
                await ctx.step(async_noisy, r)
        finally:
            stop.set()
            thread.join()
        print(f"chatter lines {said[0]}")
        return rounds

    @workflow
    async def endless(ctx, n):
        i = 0
        while True:
            ctx.log(f"endless {i}")
            await ctx.step(noisy_step, i, name="noisy")
            i += 1

    @workflow
    async def gated(ctx, n):  # branches queue behind concurrency=1 when the run is stopped
        return await ctx.parallel([ctx.step(noisy_step, i, name="noisy") for i in range(n)], concurrency=1)

    if __name__ == "__main__":
        print("result", run(noisy, int(sys.argv[1]), fresh=True))
''')

ERASE = re.compile(r"\r?\x1b\[2K|\x1b\[1A")


def screen_lines(raw: str) -> list[str]:
    """The lines a person sees scroll by: a row rubbed out starts a fresh line, colours are dropped."""
    return [ANSI.sub("", line).rstrip("\r") for line in ERASE.sub("\n", raw.replace("\r\n", "\n")).split("\n")]


def expected_lines(rounds: int) -> list[str]:
    out = []
    for r in range(rounds):
        out.append(f"loop {r}")
        for j in range(4):
            i = r * 10 + j
            for k in range(12):
                out += [f"step-line {i}.{k}", f"logged {i}.{k}", f"stderr {i}.{k}"]
            out += [f"part-ial {i}", f"bytes {i}", f"subprocess {i}", f"descriptor {i}"]
        out += [f"async {r}.{k}" for k in range(8)]
    return out


def check_screen(raw: str, rounds: int) -> None:
    """Every line the workflow printed shows once and whole (never glued to a row of the view), the threads'
    chatter is all there, the only warnings are the workflow's own, and nothing else went wrong."""
    lines = screen_lines(raw)
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    missing = [line for line in expected_lines(rounds) if counts.get(line) != 1]
    assert not missing, (missing[:5], raw[-3000:])
    said = next(int(line.split()[-1]) for line in lines if line.startswith("chatter lines "))
    assert all(counts.get(f"chatter {n}") == 1 for n in range(said)), said
    warned = [line for line in lines if "Warning" in line]
    assert len(warned) == rounds * 4 and all("UserWarning: careful " in line for line in warned), warned
    for bad in ("Traceback", "never awaited", "Exception in thread", "RuntimeError", "Error:"):
        assert bad not in raw, raw[-3000:]
    assert f"result {rounds}" in lines
    assert any(re.fullmatch(r"✓ noisy-\w+  completed  \d+ steps: \d+ ran · 0 replayed", line) for line in lines), \
        raw[-2000:]
    assert "\x1b[?25h" in raw  # the cursor is shown again


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "noisy.py").write_text(NOISY)
    return tmp_path


def drive(project: Path, runs: int, columns: int = 80) -> list[float]:
    """`durably run noisy.py` `runs` times on a terminal; every run ends by itself and shows a clean screen.
    Returns how long each took."""
    took = []
    for n in range(runs):
        rounds = 1 + n % 3
        started = time.monotonic()
        with Terminal("run", "noisy.py", "--", str(rounds), cwd=project, columns=columns) as term:
            code = term.wait(60)
            assert code == 0, (n, code, term.raw[-3000:])
            check_screen(term.raw, rounds)
        took.append(time.monotonic() - started)
    return took


def test_heavy_output_never_garbles_or_hangs_the_view(project: Path) -> None:
    took = drive(project, 4)
    took += drive(project, 2, columns=120)
    print(f"\n{len(took)} runs on a pty: median {statistics.median(took):.2f}s, max {max(took):.2f}s")


@pytest.mark.slow
def test_hundreds_of_heavy_runs_on_a_pty_never_hang(project: Path) -> None:
    took = drive(project, 300)
    print(f"\n300 runs on a pty: median {statistics.median(took):.2f}s, max {max(took):.2f}s, "
          f"total {sum(took):.0f}s; none hung, none garbled")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_act_within_a_second_while_the_view_is_busy(project: Path, sig: int, code: int) -> None:
    times = []
    for attempt in range(3):
        with Terminal("run", "noisy.py", "--workflow", "endless", "--input", str(attempt), cwd=project) as term:
            assert term.wait_for("endless 3", 30), term.raw[-2000:]
            exited, seconds = interrupt(term, sig)
            assert exited == code, (exited, term.raw[-2000:])
            text = term.text
            how = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
            assert f"{how}; run the same command again to resume where it stopped" in text
            assert "\x1b[?25h" in term.raw
            assert "Traceback" not in text and "never awaited" not in text
            times.append(seconds)
    print(f"\n{signal.Signals(sig).name} to exit: {', '.join(f'{t:.2f}s' for t in times)}")
    assert max(times) < 1.5, times


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopping_a_fan_out_with_branches_still_queued_warns_of_nothing(project: Path, sig: int, code: int) -> None:
    with Terminal("run", "noisy.py", "--workflow", "gated", "--input", "400", cwd=project) as term:
        assert term.wait_for("step-line 3.0", 30), term.raw[-2000:]
        exited, seconds = interrupt(term, sig)
        assert exited == code, (exited, term.raw[-2000:])
        assert "never awaited" not in term.text and "Traceback" not in term.text, term.raw[-3000:]
        assert seconds < 1.5, seconds


def test_the_readme_first_command_shows_a_clean_view(tmp_path: Path) -> None:
    for columns in (80, 120):
        with Terminal("run", str(ROOT / "examples" / "quickstart.py"), cwd=tmp_path, columns=columns) as term:
            assert term.wait(60) == 0, term.raw[-2000:]
            lines = screen_lines(term.raw)
        assert "loaded 5 orders" in lines and "priced 5 orders, total 71.40" in lines, lines
        assert not any("Warning" in line or "Traceback" in line for line in lines), term.raw
        assert any(re.fullmatch(r"✓ checkout-\w+  completed  8 steps: 8 ran · 0 replayed · 1 retry", line)
                   for line in lines), lines
        rows = [line for line in lines if line.startswith("  checkout-")]
        assert rows and all(re.fullmatch(r"  checkout-\w+  \d+ done( · \d+ (running|retrying))*( {2}\S.*)?", row)
                            for row in rows), rows
        assert all(len(row) < columns for row in rows)


FAMILY = textwrap.dedent('''
    import time
    from durably_py import workflow

    def nap(n):
        time.sleep(0.05)
        return n

    @workflow
    async def kid(ctx, n):
        return await ctx.step(nap, n)

    @workflow
    async def mom(ctx, count):
        first = await ctx.step(nap, 0)
        await ctx.sleep(0.2)
        handles = [await ctx.spawn(kid, n) for n in range(count)]
        total = 0
        for handle in handles:
            total += await ctx.join(handle)
        return first + total + await ctx.step(nap, 1)
''')


def test_the_summary_and_inspect_count_steps_alike_and_the_parent_stays_on_top(tmp_path: Path) -> None:
    (tmp_path / "family.py").write_text(FAMILY)
    with Terminal("run", "family.py", "-w", "mom", "-i", "14", cwd=tmp_path, rows=30) as term:
        assert term.wait(60) == 0, term.raw[-2000:]
        raw = term.raw
    frames = [frame for frame in re.split(r"\r\x1b\[2K(?:\x1b\[1A\x1b\[2K)*", raw) if "durably  " in frame]
    rows = [[ANSI.sub("", line) for line in frame.replace("\r\n", "\n").split("\n")] for frame in frames]
    with_kids = [frame for frame in rows if any(line.startswith("  kid-") for line in frame)]
    assert with_kids, raw[-2000:]
    for frame in with_kids:  # however many children ran, the parent's row comes first
        shown = [line for line in frame if line.startswith(("  kid-", "  mom-", "  … "))]
        assert shown[0].startswith("  mom-"), frame
    assert any(line.startswith("  … ") and line.endswith(" more runs") for frame in rows for line in frame)
    lines = screen_lines(raw)
    summary = next(line for line in lines if line.startswith("✓ mom-"))
    run_id = summary.split()[1]
    assert summary.endswith("completed  2 steps: 2 ran · 0 replayed"), summary
    shown = durably("inspect", run_id, cwd=tmp_path).stdout
    assert "steps (2) · ctx calls (29)" in shown, shown  # a sleep, 14 spawns and 14 joins apart
