"""The `gptop` command line.

    gptop train [trainer options]        start a run and show it
    gptop train --nproc 8 [options]      the same on 8 ranks of this node (torchrun; --parallel ddp|fsdp)
    gptop train --resume RUN_DIR         continue a run from its newest valid checkpoint
    gptop tune --budget 30m [options]    train while tuning the toggles on the live run
    gptop report RUN_DIR                 summarize a run
    gptop                                monitor: device dashboard, attach to or replay a run

Global flags (before or after the command): --no-ui, --json, --interval.
Exit codes: 0 done, 1 the run failed, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from trainer.contract.config import ConfigError, TrainConfig, add_arguments, config_from_args
from trainer.contract.rundir import default_run_dir, resume_config

from .session import EXIT_DONE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, Session, SessionOptions

TRAINER_EXIT_CONFIG = 2


def _global_flags(parser: argparse.ArgumentParser, suppress: bool) -> None:
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = parser.add_argument_group("display")
    g.add_argument("--no-ui", dest="no_ui", action="store_true", default=d(False),
                   help="no terminal UI: readable lines (or JSON lines with --json) on stdout")
    g.add_argument("--json", action="store_true", default=d(False),
                   help="with --no-ui: print every event as one JSON line")
    g.add_argument("--interval", type=float, default=d(0.5), metavar="S",
                   help="device sampling period in seconds (default: 0.5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptop", description="htop for a training run, with a live autotuner.")
    _global_flags(parser, suppress=False)
    parser.add_argument("--run-dir", dest="monitor_run_dir", metavar="DIR", default=None,
                        help="monitor mode: the run (or folder of runs) to attach to (default: newest in ./runs)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def run_command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _global_flags(p, suppress=True)
        add_arguments(p)
        g = p.add_argument_group("session")
        g.add_argument("--restart-on-failure", type=int, default=0, metavar="N",
                       help="restart the trainer from its last checkpoint up to N times if it dies (default: 0)")
        g.add_argument("--tensorboard", action="store_true",
                       help="also write step metrics and device samples as TensorBoard scalars (default: off)")
        d = p.add_argument_group("distributed (torchrun; see --parallel)")
        d.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="ranks (processes, one per GPU) on this node; above 1, or with several nodes, the "
                            "trainer is launched through torchrun (default: 1)")
        d.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                       help="nodes in the run, passed to torchrun (default: 1)")
        d.add_argument("--node-rank", type=int, default=None, metavar="N",
                       help="this node's rank, passed to torchrun (static rendezvous) (default: torchrun's)")
        d.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="rendezvous endpoint shared by all nodes, passed to torchrun (default: none)")
        d.add_argument("--rdzv-backend", default=None, metavar="NAME",
                       help="rendezvous backend, passed to torchrun (default: c10d with several nodes)")
        d.add_argument("--rdzv-id", default=None, metavar="ID",
                       help="rendezvous id, the same on all nodes, passed to torchrun (default: torchrun's)")
        return p

    train = run_command("train", "train a model and show the run live")
    train.add_argument("--tune", metavar="DURATION", default=None,
                       help="tune the toggles for up to DURATION (90s, 30m, 1h30m) while training (default: off)")
    tune = run_command("tune", "train while an Optuna study tunes the toggles on the live run")
    tune.add_argument("--budget", metavar="DURATION", default="30m", help="tuning budget (default: 30m)")
    for p in (train, tune):
        g = p.add_argument_group("tuning")
        g.add_argument("--tune-space", metavar="SPEC", default=None,
                       help="narrow or widen the search, e.g. 'precision=bf16;compile=off,default' (default: all "
                            "supported values)")
        g.add_argument("--storage", metavar="URL", default=None,
                       help="Optuna storage URL (sqlite:///..., postgresql://..., journal:PATH) to share studies "
                            "(default: a SQLite file in ~/.cache/gptop)")
    tune.add_argument("--tune-only", action="store_true", help="stop after writing best.toml (default: off)")

    report = sub.add_parser("report", help="summarize a run directory")
    _global_flags(report, suppress=True)
    report.add_argument("run_dir", metavar="RUN_DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command in ("train", "tune"):
            return cmd_run(ns)
        if ns.command == "report":
            from .report import print_report

            return print_report(Path(ns.run_dir), json_out=ns.json)
        from .monitor import run_monitor

        return run_monitor(ns)
    except ConfigError as e:
        print(f"gptop: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def resolve_config(ns: argparse.Namespace) -> TrainConfig:
    base = resume_config(getattr(ns, "checkpoint.resume", None))
    cfg = config_from_args(ns, base)
    if cfg.run.run_dir is None:
        cfg.run.run_dir = default_run_dir(cfg)
    return cfg


def cmd_run(ns: argparse.Namespace) -> int:
    cfg = resolve_config(ns)
    resume = cfg.checkpoint.resume
    if ns.interval <= 0:
        raise ConfigError("--interval", f"must be positive, got {ns.interval}")
    launcher = _launcher(ns)
    if launcher is not None and launcher.multi_node and _tuning_request(ns) is not None:
        raise ConfigError("--nnodes", "tuning restarts the trainer, which one gptop cannot do for other nodes; "
                                      "tune on one node (--nproc N) and train the nodes with its best.toml")
    options = SessionOptions(interval=ns.interval, restart_on_failure=ns.restart_on_failure,
                             tensorboard=ns.tensorboard, launcher=launcher)
    session = Session(cfg, options)
    from .tuning import TuningDriver, install_toggler

    install_toggler(session, space_spec=ns.tune_space, storage=ns.storage)   # `t` starts/stops tuning
    tuning = _tuning_request(ns)
    if tuning is not None:
        TuningDriver(session, **tuning).attach()
    if ns.no_ui:
        code = _run_headless(session, ns, resume)
    else:
        from .ui.app import run_app

        code = run_app(session, resume=resume)
    err = session.state.last_error()
    if code == EXIT_FAILED and err is not None and err.kind == "config":
        return EXIT_USAGE
    return code


def _launcher(ns: argparse.Namespace):
    """torchrun for --nproc > 1 or several nodes; None runs the trainer as one plain process."""
    from .supervisor import TorchrunLauncher

    if ns.nproc < 1:
        raise ConfigError("--nproc", f"must be at least 1, got {ns.nproc}")
    launcher = TorchrunLauncher(ns.nproc, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.rdzv_backend, ns.rdzv_id)
    if ns.nproc == 1 and not launcher.multi_node:
        return None
    return launcher


def _tuning_request(ns: argparse.Namespace) -> dict[str, Any] | None:
    from tuner.budget import parse_duration

    budget = ns.budget if ns.command == "tune" else getattr(ns, "tune", None)
    if budget is None:
        return None
    return {"budget_s": parse_duration(budget), "space_spec": ns.tune_space, "storage": ns.storage,
            "tune_only": getattr(ns, "tune_only", False)}


def _run_headless(session: Session, ns: argparse.Namespace, resume: str | None) -> int:
    from .headless import HeadlessView

    view = HeadlessView(session.state, json=ns.json)
    session.add_view(view)
    presses = {"n": 0}

    def on_signal(signum, frame):
        presses["n"] += 1
        session.stop(force=presses["n"] > 1)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        session.start(resume=resume)
        while session.wait(0.2) is None:
            pass
        code = session.wait()
    finally:
        session.close()
        view.close()
        for s, h in old.items():
            signal.signal(s, h)
    if code == EXIT_FAILED:
        print(f"gptop: {session.state.status_message or 'the run failed'}", file=sys.stderr)
    return code if code is not None else EXIT_FAILED
