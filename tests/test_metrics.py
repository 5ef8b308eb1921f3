"""`--metrics-port`: the run as Prometheus metrics, read back with prometheus_client's own text parser."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from helpers import ROOT, gptop_cmd
from fixtures.streams import gpu_run
from gptop.metrics import METRICS, MetricsServer
from gptop.state import RunState
from trainer.contract.events import AlertEvent, AlertKind, Severity

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def scrape(port: int) -> dict[str, list]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_read_back_by_prometheus_parser():
    state = RunState(run_dir="/runs/demo")
    for e in gpu_run(40, ranks=2):
        state.apply(e)
    state.apply(AlertEvent(id="stall-1", kind=AlertKind.STALL, severity=Severity.CRITICAL, message="m"))
    server = MetricsServer.bind(free_port(), node="node-a")
    said: list[str] = []
    try:
        server.serve(state, said.append)
        got = scrape(server.port)
    finally:
        server.close()
    assert said == [f"Prometheus metrics at http://127.0.0.1:{server.port}/metrics"]  # one line, no warning
    names = {m.name for m in METRICS}
    exposed = {re.sub(r"_(created)$", "", n) for n in got}
    assert exposed <= names, exposed - names  # every family exposed is documented in METRICS
    (step,) = got["gptop_step"]
    assert step.labels == {"node": "node-a"} and step.value == state.step
    ranks = {s.labels["rank"]: s.value for s in got["gptop_rank_step"]}
    assert set(ranks) == {"0", "1"}
    phases = {(s.labels["rank"], s.labels["phase"]) for s in got["gptop_phase_seconds"]}
    assert ("1", "backward") in phases
    assert {s.labels["gpu"] for s in got["gptop_gpu_utilization_percent"]} == {
        str(g.index) for g in state.device_sample.devices
    }
    assert got["gptop_gpu_energy_joules_total"][0].value > 0
    assert got["gptop_run_info"][0].labels["run_dir"] == "/runs/demo"
    active = {(s.labels["kind"], s.labels["severity"]): s.value for s in got["gptop_alerts_active"]}
    assert active[("stall", "critical")] == 1 and active[("loss_spike", "warning")] == 0
    assert got["gptop_alerts_raised_total"][0].value == 1
    status = {s.labels["status"]: s.value for s in got["gptop_status"]}
    assert sum(status.values()) == 1
    for m in (
        "gptop_tokens_per_second",
        "gptop_loss",
        "gptop_mfu_ratio",
        "gptop_step_seconds",
        "gptop_cpu_utilization_percent",
    ):
        assert got[m], m


def test_a_port_in_use_is_exit_2_naming_it_before_anything_starts(tmp_path, capsys, monkeypatch):
    from gptop import cli, monitor

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(monitor, "MonitorSession", lambda *a, **k: pytest.fail("a monitor was started"))
    monkeypatch.setattr(cli, "Session", lambda *a, **k: pytest.fail("a session was created"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv in (
            ["train", "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port)],
            ["run", "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port), "--", "true"],
            ["--no-ui", "--metrics-port", str(port)],
        ):  # the monitor
            code = cli.main(argv)
            err = capsys.readouterr().err
            assert code == 2 and "--metrics-port" in err and f"port {port} on 127.0.0.1 is in use" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--metrics-addr", "example.com"],
        ["train", "--metrics-addr", "1.2.3"],
        ["tune", "--metrics-port", "0"],
        ["--metrics-port", "70000"],
    ],
)
def test_bad_metrics_flags(argv, capsys):
    from gptop import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and argv[-2] in err and "Traceback" not in err


@pytest.mark.parametrize("command", [[], ["train"], ["tune"], ["run"]])
def test_metrics_addr_without_a_port_is_exit_2_naming_it(command, capsys):
    from gptop import cli

    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--metrics-addr", "0.0.0.0", *(["--", "true"] if command == ["run"] else [])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--metrics-addr 0.0.0.0" in err and "--metrics-port" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "addr,url,warned",
    [
        ("127.0.0.1", "http://127.0.0.1:{port}/metrics", False),
        ("localhost", "http://localhost:{port}/metrics", False),
        ("::1", "http://[::1]:{port}/metrics", False),
        ("0.0.0.0", "http://0.0.0.0:{port}/metrics", True),
        ("::", "http://[::]:{port}/metrics", True),
    ],
)
def test_where_metrics_are_served_is_said_and_a_non_loopback_address_is_warned_about(addr, url, warned):
    from types import SimpleNamespace

    from gptop.metrics import is_loopback

    port = free_port()  # lines() says the address and the bound port: a stand-in for the HTTP server will do
    server = MetricsServer(SimpleNamespace(server_address=(addr, port)), None, None, addr)  # type: ignore[arg-type]
    first, *rest = server.lines()
    assert first == "Prometheus metrics at " + url.format(port=port)
    assert is_loopback(addr) is not warned and len(rest) == warned
    if warned:
        assert rest[0].startswith(f"warning: --metrics-addr {addr} serves the metrics") and "127.0.0.1" in rest[0]


@pytest.mark.process
def test_the_line_where_metrics_are_served_and_its_warning_go_to_stderr_with_no_ui(tmp_path):
    """With --no-ui gptop's own lines are on stderr (stdout keeps the run's lines); the same lines are the
    dashboard's log panel's (`Session.log`)."""
    import subprocess

    port = free_port()
    r = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "run",
            "--run-dir",
            str(tmp_path / "run"),
            "--metrics-port",
            str(port),
            "--metrics-addr",
            "0.0.0.0",
            "--",
            "true",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert f"gptop: Prometheus metrics at http://0.0.0.0:{port}/metrics" in lines, r.stderr
    assert sum(x.startswith("gptop: warning: --metrics-addr 0.0.0.0 serves the metrics") for x in lines) == 1
    assert "Prometheus" not in r.stdout


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "dashboard.md").read_text()
    missing = [m.name for m in METRICS if f"`{m.name}`" not in doc]
    assert not missing, missing
