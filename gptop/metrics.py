"""`--metrics-port PORT`: the run as Prometheus metrics, for Grafana next to DCGM's exporter.

prometheus-client serves them (its own HTTP server, in a daemon thread). A custom collector reads the
session's RunState at each scrape (the library's pattern for an exporter that mirrors another system's
state: nothing is updated per event, so a run that nobody scrapes pays nothing). `METRICS` is the one
list of names, types, labels and meanings: docs/dashboard.md's table is checked against it and every
scrape's families are among it. Labels: `node` (this node's name: the run's node key on a multi-node run,
else the host name), `rank`, `phase`, `gpu` (NVML index), `kind`/`severity` (alerts).

It listens on 127.0.0.1 unless `--metrics-addr` names another address: the metrics carry the run's
configuration and paths. The port is bound before anything else starts, so a port in use is exit 2
naming it, with nothing started or created.
"""

from __future__ import annotations

import argparse
import enum
import errno
import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from trainer.contract.config import ConfigError, number_arg
from trainer.contract.events import PHASES, AlertKind, Severity
from trainer.contract.states import RunStatus

if TYPE_CHECKING:
    from .state import RunState

DEFAULT_ADDR = "127.0.0.1"


class MetricType(enum.StrEnum):
    """A Prometheus metric family's type, as the exposition format names it."""

    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed (a counter's `_total` included)
    type: MetricType
    labels: tuple[str, ...]
    help: str


METRICS: tuple[Metric, ...] = (
    Metric(
        "gptop_run_info",
        MetricType.INFO,
        ("node", "run", "run_dir", "model", "size", "device", "precision"),
        "the run: its name, directory, model, device and precision",
    ),
    Metric("gptop_status", MetricType.GAUGE, ("node", "status"), "1 for the session's status now, 0 for the others"),
    Metric("gptop_step", MetricType.GAUGE, ("node",), "the latest optimizer step done"),
    Metric("gptop_max_steps", MetricType.GAUGE, ("node",), "the step the run trains to"),
    Metric(
        "gptop_tokens",
        MetricType.GAUGE,
        ("node",),
        "tokens of the steps the run keeps, across its restarts (a rollback lowers it)",
    ),
    Metric(
        "gptop_tokens_processed_total",
        MetricType.COUNTER,
        ("node",),
        "tokens trained, the steps a rollback threw away included",
    ),
    Metric("gptop_tokens_per_second", MetricType.GAUGE, ("node",), "tokens per second at the latest step event"),
    Metric("gptop_mfu_ratio", MetricType.GAUGE, ("node",), "model FLOPs utilization at the latest step event, 0..1"),
    Metric("gptop_loss", MetricType.GAUGE, ("node",), "the latest logged training loss"),
    Metric("gptop_eval_loss", MetricType.GAUGE, ("node",), "the latest validation loss"),
    Metric("gptop_learning_rate", MetricType.GAUGE, ("node",), "the learning rate at the latest step event"),
    Metric("gptop_grad_norm", MetricType.GAUGE, ("node",), "the gradient norm at the latest step event"),
    Metric("gptop_energy_joules_per_token", MetricType.GAUGE, ("node",), "energy per token over the recent steps"),
    Metric("gptop_rank_step", MetricType.GAUGE, ("node", "rank"), "each rank's latest logged step"),
    Metric(
        "gptop_step_seconds", MetricType.GAUGE, ("node", "rank"), "each rank's mean step time over its latest interval"
    ),
    Metric(
        "gptop_phase_seconds",
        MetricType.GAUGE,
        ("node", "rank", "phase"),
        "each rank's mean time per step in each phase (data, forward, backward, optimizer, other)",
    ),
    Metric("gptop_memory_bytes", MetricType.GAUGE, ("node", "rank"), "each rank's device memory in use by the trainer"),
    Metric("gptop_gpu_utilization_percent", MetricType.GAUGE, ("node", "gpu"), "share of time a kernel ran (NVML)"),
    Metric("gptop_gpu_memory_used_bytes", MetricType.GAUGE, ("node", "gpu"), "GPU memory used, whole device"),
    Metric("gptop_gpu_memory_total_bytes", MetricType.GAUGE, ("node", "gpu"), "GPU memory"),
    Metric("gptop_gpu_power_watts", MetricType.GAUGE, ("node", "gpu"), "GPU power draw"),
    Metric("gptop_gpu_power_limit_watts", MetricType.GAUGE, ("node", "gpu"), "GPU enforced power limit"),
    Metric(
        "gptop_gpu_energy_joules_total",
        MetricType.COUNTER,
        ("node", "gpu"),
        "NVML's energy counter (since the driver loaded: use rate() or increase())",
    ),
    Metric("gptop_gpu_temperature_celsius", MetricType.GAUGE, ("node", "gpu"), "GPU temperature"),
    Metric("gptop_gpu_sm_clock_mhz", MetricType.GAUGE, ("node", "gpu"), "SM clock"),
    Metric(
        "gptop_gpu_ecc_uncorrected_errors",
        MetricType.GAUGE,
        ("node", "gpu"),
        "uncorrected ECC errors since the driver loaded",
    ),
    Metric("gptop_cpu_utilization_percent", MetricType.GAUGE, ("node",), "whole-machine CPU utilization"),
    Metric("gptop_cpu_memory_used_bytes", MetricType.GAUGE, ("node",), "host memory used (total - available)"),
    Metric("gptop_cpu_power_watts", MetricType.GAUGE, ("node",), "CPU package power (RAPL)"),
    Metric("gptop_trainer_rss_bytes", MetricType.GAUGE, ("node",), "resident memory of the trainer's processes"),
    Metric("gptop_trainer_cpu_percent", MetricType.GAUGE, ("node",), "the trainer's processes' share of the machine"),
    Metric("gptop_alerts_active", MetricType.GAUGE, ("node", "kind", "severity"), "alerts raised and not resolved"),
    Metric("gptop_alerts_raised_total", MetricType.COUNTER, ("node",), "alerts raised since gptop started"),
    Metric("gptop_tuner_active", MetricType.GAUGE, ("node",), "1 while the autotuner works"),
    Metric("gptop_tuner_phase_info", MetricType.INFO, ("node", "phase"), "the autotuner's phase"),
    Metric("gptop_tuner_budget_left_seconds", MetricType.GAUGE, ("node",), "the tuning budget left"),
    Metric("gptop_tuner_trials", MetricType.GAUGE, ("node",), "trials run"),
    Metric("gptop_tuner_best_tokens_per_second", MetricType.GAUGE, ("node",), "the best trial's tokens per second"),
)
_BY_NAME = {m.name: m for m in METRICS}


def addr_arg(text: str) -> str:
    """`--metrics-addr`: an IP address (0.0.0.0 or :: for every interface) or `localhost`."""
    text = text.strip()
    if text != "localhost":
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an IP address (127.0.0.1, 0.0.0.0, ::1) or localhost"
            ) from None
    return text


def is_loopback(addr: str) -> bool:
    """Whether `addr` (an --metrics-addr value) is reachable from this machine only."""
    return addr == "localhost" or ipaddress.ip_address(addr).is_loopback


def add_metrics_arguments(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """`--metrics-port`/`--metrics-addr` (`suppress`: on a subcommand whose parent has them too)."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = parser.add_argument_group("metrics (Prometheus)")
    g.add_argument(
        "--metrics-port",
        type=number_arg(int, 1, 65535),
        default=d(None),
        metavar="PORT",
        help="serve Prometheus metrics at http://ADDR:PORT/metrics (docs/dashboard.md lists them) "
        "(default: off; 1 <= x <= 65535)",
    )
    g.add_argument(
        "--metrics-addr",
        type=addr_arg,
        default=d(DEFAULT_ADDR),
        metavar="ADDR",
        help="the address the metrics listen on, with --metrics-port; they reveal the run's configuration and "
        f"paths, so another address than a loopback one is warned about (default: {DEFAULT_ADDR}; 0.0.0.0 for "
        "every interface)",
    )


class RunCollector:
    """A prometheus_client collector over a RunState (set once the session exists)."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node or socket.gethostname()
        self.state: "RunState | None" = None

    def describe(self) -> list[Any]:
        return []  # families depend on the run (GPUs, ranks): not described ahead of a scrape

    def collect(self) -> Iterator[Any]:
        state = self.state
        if state is None:
            return
        out = Families(self.node)
        with state.lock:
            _run_metrics(out, state)
            _rank_metrics(out, state)
            _device_metrics(out, state)
            _alert_and_tuner_metrics(out, state)
        jpt = state.joules_per_token()
        if jpt is not None:
            out.put("gptop_energy_joules_per_token", jpt)
        yield from out.families.values()


class Families:
    """One scrape's metric families, created as their first sample comes, each sample labelled with the node."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.families: dict[str, Any] = {}

    def family(self, name: str) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        f = self.families.get(name)
        if f is None:
            m = _BY_NAME[name]
            if m.type is MetricType.COUNTER:
                f = CounterMetricFamily(name[: -len("_total")], m.help, labels=m.labels)
            elif m.type is MetricType.INFO:
                f = InfoMetricFamily(name[: -len("_info")], m.help, labels=m.labels[:1])
            else:
                f = GaugeMetricFamily(name, m.help, labels=m.labels)
            self.families[name] = f
        return f

    def put(self, name: str, value: Any, *labels: str) -> None:
        """A sample; an unknown value (None) is left out, not exported as 0."""
        if value is None or isinstance(value, bool):
            return
        self.family(name).add_metric([self.node, *labels], float(value))


def _run_metrics(out: Families, state: "RunState") -> None:
    last, model = state.last_step, state.model
    info = {
        "run": state.run_name or "",
        "run_dir": state.run_dir or "",
        "model": (model.family or "") if model else "",
        "size": (model.size or "") if model else "",
        "device": (state.device.name or state.device.type) if state.device else "",
        "precision": state.precision_label() or "",
    }
    out.family("gptop_run_info").add_metric([out.node], info)
    for s in RunStatus:
        out.family("gptop_status").add_metric([out.node, s.value], 1.0 if state.status is s else 0.0)
    out.put("gptop_step", state.step)
    out.put("gptop_max_steps", state.total_steps)
    out.put("gptop_tokens", state.tokens)
    out.put("gptop_tokens_processed_total", state.counts.processed)
    if last is not None:
        out.put("gptop_tokens_per_second", last.tokens_per_s)
        out.put("gptop_mfu_ratio", last.mfu)
        out.put("gptop_loss", last.loss)
        out.put("gptop_learning_rate", last.lr)
        out.put("gptop_grad_norm", last.grad_norm)
    if state.last_eval is not None:
        out.put("gptop_eval_loss", state.last_eval.loss)


def _rank_metrics(out: Families, state: "RunState") -> None:
    for rank, e in sorted(state.ranks.items()):
        r = str(rank)
        out.put("gptop_rank_step", e.step, r)
        out.put("gptop_step_seconds", None if e.step_ms is None else e.step_ms / 1000, r)
        for p in PHASES:
            ms = (e.phases_ms or {}).get(p)
            out.put("gptop_phase_seconds", None if ms is None else ms / 1000, r, p)
        out.put("gptop_memory_bytes", e.mem_bytes, r)


def _device_metrics(out: Families, state: "RunState") -> None:
    sample = state.device_sample
    if sample is None:
        return
    for g in sample.devices:
        i = str(g.index)
        out.put("gptop_gpu_utilization_percent", g.util_pct, i)
        out.put("gptop_gpu_memory_used_bytes", g.mem_used, i)
        out.put("gptop_gpu_memory_total_bytes", g.mem_total, i)
        out.put("gptop_gpu_power_watts", g.power_w, i)
        out.put("gptop_gpu_power_limit_watts", g.power_limit_w, i)
        out.put("gptop_gpu_energy_joules_total", g.energy_j, i)
        out.put("gptop_gpu_temperature_celsius", g.temp_c, i)
        out.put("gptop_gpu_sm_clock_mhz", g.sm_clock_mhz, i)
        out.put("gptop_gpu_ecc_uncorrected_errors", g.ecc_uncorrected, i)
    c = sample.cpu
    if c is not None:
        out.put("gptop_cpu_utilization_percent", c.util_pct)
        out.put("gptop_cpu_memory_used_bytes", c.mem_used)
        out.put("gptop_cpu_power_watts", c.power_w)
        out.put("gptop_trainer_rss_bytes", c.proc_rss)
        out.put("gptop_trainer_cpu_percent", c.proc_cpu_pct)


def _alert_and_tuner_metrics(out: Families, state: "RunState") -> None:
    active = list(state.alerts_active.values())
    for kind in AlertKind:
        for sev in Severity:
            n = sum(1 for a in active if a.kind is kind and a.severity is sev)
            out.family("gptop_alerts_active").add_metric([out.node, kind.value, sev.value], float(n))
    out.family("gptop_alerts_raised_total").add_metric([out.node], float(state.alerts_raised))
    tu = state.tuner
    out.put("gptop_tuner_active", 1.0 if tu.active else 0.0)
    if tu.phase is not None:
        out.family("gptop_tuner_phase_info").add_metric([out.node], {"phase": tu.phase})
    out.put("gptop_tuner_budget_left_seconds", state.tuner_budget_left() if tu.active else None)
    out.put("gptop_tuner_trials", tu.trials_run if tu.trials_run is not None else len(tu.trials) or None)
    best = tu.best
    out.put("gptop_tuner_best_tokens_per_second", best.tokens_per_s if best is not None else None)


class MetricsServer:
    """The HTTP endpoint: bound by `bind` (before anything starts), fed a state by `serve`, closed by `close`."""

    def __init__(self, httpd: Any, thread: threading.Thread, collector: RunCollector, addr: str) -> None:
        self.httpd = httpd
        self.thread = thread
        self.collector = collector
        self.addr = addr

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @classmethod
    def bind(cls, port: int, addr: str = DEFAULT_ADDR, node: str | None = None) -> "MetricsServer":
        """Listen now; a port in use (or an address not of this machine) is a ConfigError naming the flag."""
        from prometheus_client import CollectorRegistry, start_http_server

        collector = RunCollector(node)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)  # a duck-typed Collector, as the docs show
        try:
            httpd, thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            what = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror or e})"
            raise ConfigError(
                "--metrics-port", f"port {port} on {addr} {what}; choose another --metrics-port (or --metrics-addr)"
            ) from None
        return cls(httpd, thread, collector, addr)

    def serve(self, state: "RunState", say: Callable[[str], None]) -> None:
        """Serve `state` from now on, and `say` where (the log panel, stderr with --no-ui)."""
        self.collector.state = state
        for line in self.lines():
            say(line)

    def lines(self) -> list[str]:
        """Where the metrics are served; a warning when other machines can read them."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        out = [f"Prometheus metrics at http://{host}:{self.port}/metrics"]
        if not is_loopback(self.addr):
            out.append(
                f"warning: --metrics-addr {self.addr} serves the metrics, which show the run's configuration and "
                f"paths, to every machine that can reach this one on port {self.port} (the default, "
                f"{DEFAULT_ADDR}, keeps them on this machine)"
            )
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def bind_metrics(ns: argparse.Namespace, node: str | None = None) -> MetricsServer | None:
    """The metrics server a command line asks for (`--metrics-port`), bound now; None without the flag."""
    port = getattr(ns, "metrics_port", None)
    if port is None:
        return None
    return MetricsServer.bind(port, getattr(ns, "metrics_addr", DEFAULT_ADDR), node)
