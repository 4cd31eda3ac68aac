"""docs/restate.md's 3-node cluster how-to, followed as written: three restate-server nodes from the npm binary
with the documented TOML, a SIGKILL of one node while runs are in flight, and the node rejoining."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
from restate_env import ROOT, Service, free_port, http, server_binary

pytest.importorskip("restate", reason="the restate extra (restate-sdk) is not installed")
if server_binary() is None:  # pragma: no cover - CI installs it via .ci/run
    pytest.skip("restate-server is not installed (.ci/run installs it into .ci/restate)", allow_module_level=True)

FLOWS = str(ROOT / "tests" / "restate_flows.py")


def node_config(n: int, ports: dict[int, tuple[int, int, int]], base: Path) -> str:
    """The documented n1.toml, made into node `n`'s file: its name, ports and base dir; auto-provision off but on n1."""
    doc = (ROOT / "docs" / "restate.md").read_text()
    text = doc.split("## A 3-node cluster")[1].split("```toml\n")[1].split("```")[0]
    node, admin, ingress = ports[n]
    text = text.replace('node-name = "n1"', f'node-name = "n{n}"').replace("/var/lib/restate/n1", str(base / f"n{n}"))
    text = text.replace('bind-address = "127.0.0.1:25121"', f'bind-address = "127.0.0.1:{node}"')
    text = text.replace('advertised-address = "http://127.0.0.1:25121/"', f'advertised-address = "http://127.0.0.1:{node}/"')
    for i in (1, 2, 3):
        text = text.replace(f"127.0.0.1:2512{i}/", f"127.0.0.1:{ports[i][0]}/")
    text = text.replace("127.0.0.1:29071", f"127.0.0.1:{admin}").replace("127.0.0.1:28081", f"127.0.0.1:{ingress}")
    if n != 1:
        text = "\n".join("auto-provision = false" if line.startswith("auto-provision") else line
                         for line in text.splitlines())
    return text


def branches(tag: str, n: int, steps: int) -> list[list[str]]:
    return [[f"{tag}-{b}-{s}" for s in range(steps)] for b in range(n)]


@pytest.mark.slow
def test_documented_three_node_cluster_survives_a_node_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from durably_py.restate.client import RestateClient

    monkeypatch.setenv("DURABLY_TEST_MARKS", str(tmp_path / "marks"))
    binary = server_binary()
    assert binary is not None
    ports = {n: (free_port(), free_port(), free_port()) for n in (1, 2, 3)}
    nodes: dict[int, subprocess.Popen[bytes]] = {}

    def start(n: int) -> None:
        config = tmp_path / f"n{n}.toml"
        config.write_text(node_config(n, ports, tmp_path))
        with open(tmp_path / f"n{n}.log", "ab") as log:
            nodes[n] = subprocess.Popen([binary, "--config-file", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "RESTATE_LOG_FILTER": "warn"})

    service = Service([FLOWS], free_port(), f"http://127.0.0.1:{ports[1][1]}", tmp_path / "service.log")
    try:
        for n in (1, 2, 3):
            start(n)
            time.sleep(1)
        deadline = time.monotonic() + 120
        while True:
            try:
                http("GET", f"http://127.0.0.1:{ports[1][1]}/health", timeout=2)
                for n in (1, 2, 3):
                    http("GET", f"http://127.0.0.1:{ports[n][2]}/restate/health", timeout=2)
                break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline, (tmp_path / "n1.log").read_text()[-2000:]
                time.sleep(0.5)
        service.start()  # registers through n1's admin API
        via = {n: RestateClient(f"http://127.0.0.1:{ports[n][2]}", f"http://127.0.0.1:{ports[n][1]}", timeout=60)
               for n in (1, 2, 3)}
        spec = {"branches": 4, "steps": 3, "tag": "first"}
        while True:  # another node's ingress knows the new deployment once the registration has spread
            try:
                via[2].start("fan_branches", spec, key="first")
                break
            except Exception as exc:  # noqa: BLE001 - "no workflow durably.fan_branches" until then
                assert time.monotonic() < deadline, repr(exc)
                time.sleep(0.5)
        assert via[2].result("first") == branches("first", 4, 3)

        keys = [f"inflight-{i}" for i in range(8)]
        for key in keys:
            via[2].start("fan_branches", {"branches": 3, "steps": 3, "tag": key}, key=key)
        time.sleep(0.3)
        nodes[1].send_signal(signal.SIGKILL)
        nodes[1].wait()
        for key in keys:
            assert via[3].result(key) == branches(key, 3, 3)

        start(1)
        deadline = time.monotonic() + 120
        while True:
            try:
                via[1].start("fan_branches", {"branches": 2, "steps": 1, "tag": "back"}, key="back")
                break
            except Exception as exc:  # noqa: BLE001 - n1's ingress answers once it has rejoined
                assert time.monotonic() < deadline, (repr(exc), (tmp_path / "n1.log").read_text()[-2000:])
                time.sleep(0.5)
        assert via[1].result("back") == branches("back", 2, 1)
    finally:
        service.stop()
        for proc in nodes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in nodes.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
