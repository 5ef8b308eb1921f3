"""The `gptop` command line.

    gptop train [trainer options]        start a run and show it
    gptop train --nproc 8 [options]      the same on 8 ranks of this node (torchrun; --parallel ddp|fsdp)
    gptop train --resume RUN_DIR         continue a run from its newest valid checkpoint
    gptop tune --budget 30m [options]    train while tuning the toggles on the live run
    gptop tune --budget 5m -- CMD [ARGS] tune your own transformers.Trainer script on its live run
    gptop run [options] -- CMD [ARGS]    your own training command, watched (gptop.integrations inside it)
    gptop report RUN_DIR                 summarize a run
    gptop export RUN_DIR OUT_DIR         write a checkpoint as a Hugging Face model directory
    gptop sample RUN_DIR --prompt TEXT   generate text from a checkpoint
    gptop doctor [--device cuda]         check every device path on this machine, and what works
    gptop                                monitor: device dashboard, attach to or replay a run

Global flags (before or after the command): --no-ui, --json, --interval.
Exit codes: 0 done, 1 the run failed, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Callable

from trainer.contract import inputs
from trainer.contract.common import MAX_STEP
from trainer.contract.config import ConfigError, OneLineParser, add_arguments, number_arg
from trainer.contract.states import ErrorKind
from trainer.contract.tools import add_export_arguments, add_sample_arguments

from . import preflight
from .alert_options import add_alert_arguments
from .controls import STOP_SIGNALS, TUI_STOP_SIGNALS, StopSignals
from .metrics import add_metrics_arguments, bind_metrics
from .preflight import ProgramPlan, RunPlan
from .session import EXIT_FAILED, EXIT_PIPE, EXIT_USAGE, Session, SessionOptions

# gptop's own flags, converted and checked at parse time like the config's (trainer.contract.config.number_arg,
# trainer.contract.inputs.path_arg): a bad value is exit 2 naming the flag before anything starts.
MAX_NODES = 100_000
MAX_RESTARTS = 1000
MAX_GRACE_S = 86400.0


def nnodes_arg(text: str) -> str:
    """`--nnodes N` or `MIN:MAX` (torchrun's elastic range), each 1..MAX_NODES and MIN <= MAX."""
    parts = text.split(":")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX")
    count = number_arg(int, 1, MAX_NODES)
    values = [count(x) for x in parts]
    if len(values) == 2 and values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN is more than MAX")
    return text.strip()


def endpoint_arg(text: str) -> str:
    """`--rdzv-endpoint HOST[:PORT]`, the port 1..65535."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), ""
    if not host or any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if port:
        number_arg(int, 1, 65535)(port)
    return text.strip()


class Parser(OneLineParser):
    """argparse, with its options and subcommands readable: the input tests iterate every flag of every
    subcommand (a new one included) and check that its values are checked."""

    @property
    def actions(self) -> list[argparse.Action]:
        return list(self._actions)

    @property
    def commands(self) -> dict[str, "Parser"]:
        return next((dict(a.choices) for a in self._actions if isinstance(a.choices, dict)), {})


# The global flags, given before or after the command, and where each acts. `--json` means one thing
# everywhere: the command's output is JSON lines on stdout (a run's every event, a report, a result), for a
# script, and no dashboard (it implies --no-ui); every command has output to give so. `--no-ui` is accepted
# everywhere (a command without a dashboard has none to turn off). The device-sampling and metrics flags act
# where gptop samples a run (train, tune, run and the monitor, command None); given to another command, they
# are refused (exit 2, naming the flag) rather than ignored.
SAMPLING = ("train", "tune", "run", None)
GLOBAL_FLAGS = {  # dest -> (flag, default, the commands it acts on)
    "no_ui": ("--no-ui", False, None),
    "json": ("--json", False, None),
    "interval": ("--interval", 0.5, SAMPLING),
    "metrics_port": ("--metrics-port", None, SAMPLING),
    "metrics_addr": ("--metrics-addr", None, SAMPLING),
}
JSON_HELP = {
    "run": "JSON lines on stdout: every event of the run, one per line (the closing summary goes to stderr); no "
    "dashboard (implies --no-ui)",
    "monitor": "JSON lines on stdout: every event of the watched run, one per line; no dashboard (implies --no-ui)",
    "report": "the report as one JSON line on stdout",
}


def _global_flags(parser: argparse.ArgumentParser, json_help: str = JSON_HELP["run"], sampling: bool = True) -> None:
    """The global flags that act on this command; their defaults are filled in by `_check_global_flags`, so
    that one given before the command is not overwritten by the subcommand's."""
    g = parser.add_argument_group("display")
    g.add_argument(
        "--no-ui",
        dest="no_ui",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no terminal UI: readable lines (or JSON lines with --json) on stdout" if sampling else argparse.SUPPRESS,
    )
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=json_help)
    if sampling:
        g.add_argument(
            "--interval",
            type=number_arg(float, 0.01, 3600),
            default=argparse.SUPPRESS,
            metavar="S",
            help="device sampling period in seconds (default: 0.5; 0.01 <= S <= 3600)",
        )


def _check_global_flags(parser: "Parser", ns: argparse.Namespace) -> None:
    """A global flag given to a command it does nothing for is refused (one line, exit 2); the others get
    their defaults. `--json` implies `--no-ui`."""
    for dest, (flag, default, acts_on) in GLOBAL_FLAGS.items():
        if not hasattr(ns, dest):
            setattr(ns, dest, default)
        elif acts_on is not None and ns.command not in acts_on:
            where = ", ".join(c for c in acts_on if c) + " and the monitor (gptop with no command)"
            parser.commands[ns.command].error(f"{flag} does nothing here; it acts on gptop {where}")
    if ns.metrics_addr is None:
        from .metrics import DEFAULT_ADDR

        ns.metrics_addr = DEFAULT_ADDR
    elif ns.metrics_port is None:  # an address to serve nothing on: a forgotten --metrics-port, not a choice
        said_by = parser.commands[ns.command] if ns.command else parser
        said_by.error(f"--metrics-addr {ns.metrics_addr}: metrics are served only with --metrics-port PORT")
    if ns.json:
        ns.no_ui = True
    elif not ns.no_ui and ns.command in SAMPLING and not has_terminal():
        # A dashboard needs a terminal to draw on and to read keys from; drawn into a file or a pipe it is
        # unreadable and costs a core the trainer could use.
        ns.no_ui = True
        print("gptop: no terminal (stdin or stdout is not a tty): printing lines, as with --no-ui", file=sys.stderr)


def has_terminal() -> bool:
    """Whether the dashboard has a terminal: stdin to read keys from and stdout to draw on."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stdout))


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gptop")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


@functools.lru_cache(maxsize=1)
def build_parser() -> Parser:
    """gptop's command line. Built once per process and shared (a program that parses many command lines,
    such as the test suite, builds its hundred options once): callers read it and never change it."""
    parser = Parser(
        prog="gptop",
        description="htop for a training run, with a live autotuner. With no command: "
        "the monitor (devices, and the newest run in ./runs or --run-dir).",
    )
    parser.add_argument("--version", action="version", version=f"gptop {_version()}")
    _global_flags(parser, json_help=JSON_HELP["monitor"])
    add_metrics_arguments(parser, suppress=True)
    parser.add_argument(
        "--run-dir",
        dest="monitor_run_dir",
        metavar="DIR",
        default=None,
        type=inputs.path_arg(inputs.check_runs_folder, "--run-dir"),
        help="monitor mode: the run (or folder of runs) to attach to (default: newest in ./runs)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train_and_tune(sub)
    _add_run(sub)
    _add_readers(sub)
    return parser


def _run_command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A `train`/`tune` subcommand: the trainer's options, the session's, the alerts, the metrics and torchrun's."""
    p = sub.add_parser(name, help=help, description=help)
    _global_flags(p)
    add_arguments(p)
    g = p.add_argument_group("session")
    g.add_argument(
        "--restart-on-failure",
        type=number_arg(int, 0, MAX_RESTARTS),
        default=0,
        metavar="N",
        help="restart the trainer from its last checkpoint up to N times if it dies "
        f"(default: 0; at most {MAX_RESTARTS})",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write step metrics and device samples as TensorBoard scalars (default: off)",
    )
    g.add_argument(
        "--wandb",
        action="store_true",
        help="also log them to a Weights & Biases run in RUN_DIR/wandb (pip install -e '.[wandb]'; "
        "WANDB_MODE=offline: no account or network) (default: off)",
    )
    add_alert_arguments(p)
    add_metrics_arguments(p, suppress=True)
    d = p.add_argument_group("distributed (torchrun; see --parallel)")
    d.add_argument(
        "--nproc",
        type=number_arg(int, 1, 1024),
        default=1,
        metavar="N",
        help="ranks (processes, one per GPU) on this node; above 1, or with several nodes, the "
        "trainer is launched through torchrun (default: 1)",
    )
    d.add_argument(
        "--nnodes",
        type=nnodes_arg,
        default="1",
        metavar="N|MIN:MAX",
        help="nodes in the run, passed to torchrun (default: 1)",
    )
    d.add_argument(
        "--node-rank",
        type=number_arg(int, 0, MAX_NODES - 1),
        default=None,
        metavar="N",
        help="this node's rank, passed to torchrun (static rendezvous) (default: torchrun's)",
    )
    d.add_argument(
        "--rdzv-endpoint",
        type=endpoint_arg,
        default=None,
        metavar="HOST:PORT",
        help="rendezvous endpoint shared by all nodes, passed to torchrun (default: none)",
    )
    d.add_argument(
        "--rdzv-backend",
        default=None,
        metavar="NAME",
        help="rendezvous backend, passed to torchrun (default: c10d with several nodes)",
    )
    d.add_argument(
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="rendezvous id, the same on all nodes, passed to torchrun (default: torchrun's)",
    )
    return p


def _add_train_and_tune(sub: Any) -> None:
    """`train` and `tune`: gptop's trainer run (or, for `tune -- CMD`, a script tuned)."""
    from tuner.budget import duration_arg
    from tuner.settings import MAX_TRIALS, MAX_TRIALS_LIMIT, STABLE_WITHIN, stable_within_arg

    train = _run_command(sub, "train", "train a model and show the run live")
    train.add_argument(
        "--tune",
        metavar="DURATION",
        default=None,
        type=duration_arg("--tune"),
        help="tune the toggles for up to DURATION, a number with a unit (90s, 30m, 1h30m, 2h) while "
        "training (default: off)",
    )
    tune = _run_command(sub, "tune", "train while an Optuna study tunes the toggles on the live run")
    tune.add_argument(
        "--budget",
        metavar="DURATION",
        default="30m",
        type=duration_arg("--budget"),
        help="tuning budget, a number with a unit: 90s, 30m, 1h30m, 2h (default: 30m)",
    )
    for p in (train, tune):
        g = p.add_argument_group("tuning")
        g.add_argument(
            "--tune-space",
            metavar="SPEC",
            default=None,
            help="narrow or widen the search, e.g. 'precision=bf16;compile=off,default' (default: all "
            "supported values)",
        )
        g.add_argument(
            "--storage",
            metavar="URL",
            default=None,
            type=inputs.path_arg(inputs.check_storage),
            help="Optuna storage URL (sqlite:///..., postgresql://..., journal:PATH) to share studies "
            "(default: a SQLite file in ~/.cache/gptop)",
        )
        g.add_argument(
            "--stable-within",
            metavar="PCT",
            default=STABLE_WITHIN,
            type=stable_within_arg(),
            help="a measurement is stable, and can be compared, when its 95%% interval is within +-PCT of its "
            "estimate, e.g. 10%%: wider on a noisy shared machine settles sooner and claims less "
            f"(default: {STABLE_WITHIN * 100:g}%%)",
        )
        g.add_argument(
            "--max-trials",
            metavar="N",
            default=MAX_TRIALS,
            type=number_arg(int, 1, MAX_TRIALS_LIMIT),
            help="run at most N trials, then decide on what was measured (the budget may end it sooner; "
            f"re-measurements and the applied setting's check are not trials) (default: {MAX_TRIALS}; "
            f"1 <= N <= {MAX_TRIALS_LIMIT})",
        )
    tune.add_argument("--tune-only", action="store_true", help="stop after writing best.toml (default: off)")
    _add_quiet(tune, "with -- CMD and --no-ui: ")
    tune.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS]",
        help="tune your own transformers.Trainer script instead of gptop's trainer, e.g. -- python "
        "train.py (it calls tuned_args and resume_checkpoint: docs/your-code.md); with a "
        "command, --run-dir and --log-every are the only trainer options",
    )


def _add_run(sub: Any) -> None:
    """`gptop run [options] -- CMD`."""
    run = sub.add_parser(
        "run",
        help="run your own training command under gptop",
        description="Run your own training command as gptop's trainer: its devices, logs and exit "
        "code; with gptop.integrations in it (a probe or a callback), its steps, "
        "breakdown, loss and checkpoints, and gptop's commands. docs/your-code.md.",
    )
    _global_flags(run)
    run.add_argument(
        "--run-dir",
        metavar="DIR",
        default=None,
        type=inputs.path_arg(inputs.check_run_dir, "--run-dir"),
        help="run directory (default: runs/<time>-<script name>)",
    )
    run.add_argument(
        "--log-every",
        type=number_arg(int, 1, MAX_STEP),
        default=None,
        metavar="N",
        help=f"steps between step events (default: the program's own; 1 <= N <= {MAX_STEP})",
    )
    run.add_argument(
        "--grace",
        type=number_arg(float, 0, MAX_GRACE_S, low_open=True),
        default=30.0,
        metavar="S",
        help="seconds between the stop signal and SIGKILL when the command does not end "
        f"(default: 30; 0 < S <= {MAX_GRACE_S:g})",
    )
    _add_quiet(run, "with --no-ui: ")
    g = run.add_argument_group("session")
    g.add_argument(
        "--restart-on-failure",
        type=number_arg(int, 0, MAX_RESTARTS),
        default=0,
        metavar="N",
        help=f"start the command again if it fails, up to N times (default: 0; at most {MAX_RESTARTS})",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write step metrics and device samples as TensorBoard scalars (default: off)",
    )
    g.add_argument(
        "--wandb", action="store_true", help="also log them to a Weights & Biases run in RUN_DIR/wandb (default: off)"
    )
    add_alert_arguments(run)
    add_metrics_arguments(run, suppress=True)
    run.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS]",
        help="the command, after --: e.g. -- python train.py --lr 3e-4",
    )


def _add_quiet(p: argparse.ArgumentParser, when: str) -> None:
    p.add_argument(
        "--quiet",
        action="store_true",
        help=f"{when}do not print the command's own output lines (default: printed as they come, each "
        "prefixed [out] or [err]; on stderr with --json; all of it is in RUN_DIR/trainer.log either way)",
    )


def _add_readers(sub: Any) -> None:
    """The commands that read a run directory or the machine: report, export, sample, doctor."""
    report = sub.add_parser(
        "report",
        help="summarize a run directory",
        description="Summarize a run from its files alone (events.jsonl, device.jsonl, "
        "tuning.json): where it stands, progress, loss, speed (medians of its "
        "steady log intervals), the step's phases (means), energy, checkpoints, "
        "errors, alerts and tuning. One streaming pass: a week-long run's report "
        "costs memory bounded whatever its length. Exit 1 when the run failed.",
    )
    _global_flags(report, json_help=JSON_HELP["report"], sampling=False)
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=inputs.path_arg(inputs.check_run_to_read, "RUN_DIR"),
        help="the run directory to summarize (one that holds an events.jsonl; a run that is still "
        "going is summarized as far as it got)",
    )
    for name, add, help in (
        (
            "export",
            add_export_arguments,
            "write a run's checkpoint as a Hugging Face model "
            "directory (safetensors, config, tokenizer) that plain transformers loads",
        ),
        ("sample", add_sample_arguments, "generate text from a run's checkpoint"),
    ):
        p = sub.add_parser(name, help=help, description=help)
        add(p, json_flag=False)  # --json and --no-ui are the global flags (no UI either way)
        p.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="print the result as one JSON line (progress stays on stderr)",
        )
        p.add_argument("--no-ui", dest="no_ui", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    from .doctor import add_arguments as add_doctor_arguments

    doctor = sub.add_parser(
        "doctor",
        help="check every device path gptop uses on this machine, and what works",
        description="Detect the device, show what each toggle value can do there, and exercise "
        "each device path in a child process (exit 0 only when every path that "
        "applies passed).",
    )
    add_doctor_arguments(doctor)
    doctor.add_argument("--no-ui", dest="no_ui", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed, each flag checked and the global flags' defaults filled in (exit 2 on bad usage)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    _check_global_flags(parser, ns)
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        if ns.command == "tune" and ns.cmd:
            return cmd_program(ns, tune=True)
        if ns.command in ("train", "tune"):
            return cmd_run(ns)
        if ns.command == "run":
            return cmd_program(ns)
        if ns.command == "report":
            from .report import print_report

            return print_report(Path(ns.run_dir), json_out=ns.json)
        if ns.command == "doctor":
            from .doctor import cmd_doctor

            return cmd_doctor(ns)
        if ns.command in ("export", "sample"):
            from .tool_runner import cmd_export, cmd_sample

            return cmd_export(ns) if ns.command == "export" else cmd_sample(ns)
        from .monitor import run_monitor

        return run_monitor(ns)
    except ConfigError as e:
        print(f"gptop: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `gptop report RUN | head`: the reader has what it wanted; no traceback
        from .headless import quiet_closed_stream

        quiet_closed_stream(sys.stdout)
        return EXIT_PIPE


def cmd_run(ns: argparse.Namespace) -> int:
    """`gptop train` / `gptop tune`: the checked plan (gptop.preflight), then its session run to its end."""
    # A stop asked for from here on (Ctrl-C, SIGTERM) is kept and acted on once the session runs.
    signals = StopSignals(STOP_SIGNALS if ns.no_ui else TUI_STOP_SIGNALS).install()
    try:
        plan = preflight.plan_run(ns)
        return _hold_and_show(ns, plan, lambda options: Session(plan.cfg, options), signals)
    finally:
        signals.restore()


def cmd_program(ns: argparse.Namespace, tune: bool = False) -> int:
    """`gptop run -- CMD` (and `gptop tune -- CMD`): the checked plan (gptop.preflight), then the session shown
    as for `gptop train`; with `tune`, a tuning driver attached before CMD starts (its first process is the
    baseline)."""
    from .program import ProgramSession

    signals = StopSignals(STOP_SIGNALS if ns.no_ui else TUI_STOP_SIGNALS).install()
    try:
        plan = preflight.plan_program(ns, tune)
        return _hold_and_show(
            ns,
            plan,
            lambda options: ProgramSession(
                plan.command,
                plan.run_dir,
                options,
                log_every=plan.log_every,
                grace_s=plan.grace_s,
                signals=signals,
                tune=plan.tune,
            ),
            signals,
        )
    finally:
        signals.restore()


def _hold_and_show(
    ns: argparse.Namespace,
    plan: RunPlan | ProgramPlan,
    make_session: Callable[[SessionOptions], Session],
    signals: StopSignals,
) -> int:
    """Bind the metrics port (in use: exit 2, before the lock or anything else), take the run directory
    (preflight.claim_run_dir: a refusal from here on removes what was made), then build the session on the
    plan and show it to its end."""
    metrics = bind_metrics(ns, plan.lock.node)
    try:
        with preflight.claim_run_dir(plan.lock) as lock:
            if lock.warning:
                print(f"gptop: warning: {lock.warning}", file=sys.stderr)
            session = make_session(dataclasses.replace(plan.options, run_lock=lock))
            if metrics is not None:
                metrics.serve(session.state, session.log)
            if plan.tuning is not None:
                session.start_tuning(plan.tuning)
            return _show(ns, session, plan.resume, signals)
    finally:
        if metrics is not None:
            metrics.close()


def _show(ns: argparse.Namespace, session: Session, resume: str | None, signals: StopSignals) -> int:
    """Run the session in its view (the dashboard, or --no-ui lines) to its end, then the summary."""
    if ns.no_ui:
        from .headless import HeadlessView

        echo = session.command is not None and not getattr(ns, "quiet", False)  # a program's own lines
        view = HeadlessView(session.state, json=ns.json, echo_logs=echo)
        code = session.run_headless(view, resume=resume, signals=signals)
        if code == EXIT_FAILED and session.refusal() is None:
            print(f"gptop: {session.state.status_message or 'the run failed'}", file=sys.stderr)
        code = code if code is not None else EXIT_FAILED
    else:
        from .ui.app import run_app

        code = run_app(session, resume=resume, signals=signals)
    refusal = session.refusal()
    if refusal is not None:  # the trainer refused the configuration before its first step
        raise TrainerRefused(refusal)
    from .summary import print_summary  # the closing lines; with --json on stderr, stdout stays JSON

    print_summary(session.state, code, sys.stderr if ns.no_ui and ns.json else sys.stdout)
    err = session.state.last_error()
    if code == EXIT_FAILED and err is not None and err.kind == ErrorKind.CONFIG:
        return EXIT_USAGE
    return code


class TrainerRefused(ConfigError):
    """The trainer refused the run's configuration before its first step (a check only it can make, on the
    built model): one line, exit 2, and the run directory this command made is removed."""

    def __init__(self, said: str):
        super().__init__("", said)

    def __str__(self) -> str:
        return self.message
