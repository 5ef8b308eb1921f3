"""`gptop doctor`: one command that proves every device path on the machine at hand, and says what works.

gptop stays torch-free here as everywhere: the trainer's side (`python -m trainer.doctor`, started as a
process like the trainer itself) detects the device and runs each trainer-side path of
trainer.contract.doctor.PATHS in a child process with a timeout; gptop runs its own paths (NVML while that
process keeps the GPU busy, RAPL), computes what every toggle value can do on the detected device from
trainer.contract.capabilities (the rules the CLI and the tuner use) and prints the table, or with `--json`
the record (trainer.contract.doctor.REPORT_SCHEMA). Exit 0 only when every path that applies passed.

`python -m gptop.doctor --readme` prints the "What was verified where" table of docs/verified.md from the records
committed under docs/doctor/ (tests/test_doctor.py checks docs/verified.md against it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from trainer.contract import capabilities, inputs
from trainer.contract.config import ConfigError
from trainer.contract.device import DeviceInfo
from trainer.contract.doctor import (
    PATHS,
    REPORT_SCHEMA,
    CheckResult,
    DevicePath,
    DoctorReport,
    Line,
    Outcome,
    Status,
    exit_code,
    validate_report,
)

from .nvml import Nvml

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
EXIT_USAGE = 2


def _line_kind(line: str) -> str | None:
    """The `kind` of one of the trainer doctor's JSON lines; None for anything else (a crash's output)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("kind") if isinstance(record, dict) else None


def device_arg(text: str) -> str:
    """`--device auto|cpu|cuda|cuda:N`."""
    if not DEVICE_RE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, cpu, cuda or cuda:N")
    return text.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        metavar="cpu|cuda|cuda:N",
        help="the device to check (default: auto, the one a run would use)",
    )
    p.add_argument(
        "--quick", action="store_true", help="the quick paths only: no torch.compile, NCCL or QLoRA (default: all)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the record as one JSON line on stdout (trainer.contract.doctor.REPORT_SCHEMA)",
    )
    p.add_argument(
        "--log",
        default=None,
        type=inputs.path_arg(inputs.check_file_to_write, "--log"),
        metavar="FILE",
        help="keep the log of the checks' processes (their tracebacks) in FILE (default: a temporary file, removed "
        "at the end; its end is shown when a path fails)",
    )
    p.add_argument(
        "--timeout-scale",
        type=_scale_arg,
        default=1.0,
        metavar="F",
        help="multiply every path's timeout by F, for a slow or busy machine (default: 1; 0.1-100)",
    )


def _scale_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.1 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{v} is outside 0.1 <= F <= 100")
    return v


# --- the trainer's side ---------------------------------------------------------------------------------


def _trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer.doctor", *args]


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def trainer_side(
    requested: str, quick: bool, timeout_scale: float, log: IO[str], on_line: Callable[[dict[str, Any]], None]
) -> int | None:
    """Run `python -m trainer.doctor`, handing each JSON line to `on_line`; its exit code (None: killed)."""
    args = ["--device", requested, "--timeout-scale", str(timeout_scale)] + (["--quick"] if quick else [])
    limit = 120 + sum(p.timeout_s for p in PATHS if not p.in_gptop) * timeout_scale
    proc = subprocess.Popen(_trainer_cmd(*args), stdout=subprocess.PIPE, stderr=log, text=True, env=_child_env())
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                log.write(f"[doctor] not a JSON line: {line}")
                continue
            on_line(record)
        return proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def gpu_workload(
    requested: str, log: IO[str], seconds: float = 60.0, start_timeout: float = 180.0
) -> Iterator[str | None]:
    """Keep the GPU busy (`python -m trainer.doctor --load`) while the block runs; yields None once it is
    busy, else why it could not start. Closing its stdin stops it."""
    proc = subprocess.Popen(
        _trainer_cmd("--device", requested, "--load", str(seconds)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=_child_env(),
    )
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(start_timeout)
    problem = None
    if not got or _line_kind(got[0]) != Line.BUSY:
        problem = (
            f"the GPU workload did not start within {start_timeout:.0f} s"
            if not got
            else f"the GPU workload failed to start (exit code {proc.poll()})"
        )
    try:
        yield problem
    finally:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- gptop's own paths ------------------------------------------------------------------------------------


def gptop_side(
    dev: DeviceInfo | None, requested: str, quick: bool, log: IO[str], nvml: Any = None
) -> list[CheckResult]:
    """NVML (under a workload on the run's GPU) and RAPL: the paths gptop itself owns."""
    from .energy import check_rapl
    from .nvml import check, check_energy, index_of

    mine = [p for p in PATHS if p.in_gptop]
    if dev is None:
        return [CheckResult.of(p, Outcome.skip("the device was not detected"), 0.0) for p in mine]
    out: list[CheckResult] = []
    device_type = dev.type
    todo: list[DevicePath] = []
    for p in mine:
        if not p.applies_to(device_type):
            out.append(
                CheckResult.of(
                    p,
                    Outcome.skip(
                        f"a {p.where.value.upper()} path; the doctor ran on {device_type} (gptop doctor --device "
                        f"{p.where.value} on a machine that has one)"
                    ),
                    0.0,
                )
            )
        elif quick and not p.quick:
            out.append(CheckResult.of(p, Outcome.skip("left out by --quick"), 0.0))
        else:
            todo.append(p)
    if any(p.name == "rapl" for p in todo):
        t0 = time.monotonic()
        out.append(CheckResult.of(next(p for p in todo if p.name == "rapl"), check_rapl(), time.monotonic() - t0))
    gpu_paths = [p for p in todo if p.name in ("nvml", "energy")]
    if gpu_paths:
        nv = nvml if isinstance(nvml, Nvml) else Nvml(nvml)
        try:
            if not nv.open():
                out += [
                    CheckResult.of(p, Outcome.verdict(False, "NVML does not open", nv.reason or "no NVML"), 0.0)
                    for p in gpu_paths
                ]
            else:
                index = index_of(nv, dev.keys)
                if (
                    index is None
                    and dev.index is not None
                    and dev.index < nv.device_count
                    and not os.environ.get("CUDA_VISIBLE_DEVICES")
                ):
                    index = dev.index  # torch gave no identity; without renumbering the indices agree
                if index is None:
                    out += [
                        CheckResult.of(
                            p,
                            Outcome.verdict(
                                False,
                                "the run's GPU is not among NVML's devices",
                                f"no NVML device has the identity {dev.keys}",
                            ),
                            0.0,
                        )
                        for p in gpu_paths
                    ]
                else:
                    with gpu_workload(requested, log) as problem:
                        for p in gpu_paths:
                            t0 = time.monotonic()
                            if problem is not None:
                                outcome = Outcome.verdict(False, problem, problem)
                            else:
                                outcome = (check if p.name == "nvml" else check_energy)(nv, index)
                            out.append(CheckResult.of(p, outcome, time.monotonic() - t0))
        finally:
            nv.close()
    return out


def nvml_machine(nvml: Any = None) -> dict[str, Any]:
    """Driver, NVML and CUDA-driver versions, as NVML reports them (empty without NVML)."""
    nv = nvml if isinstance(nvml, Nvml) else Nvml(nvml)
    try:
        if not nv.open():
            return {"nvml": None, "nvml_reason": nv.reason}
        cuda = nv.query("nvmlSystemGetCudaDriverVersion_v2") or nv.query("nvmlSystemGetCudaDriverVersion")
        return {
            "driver": nv.query("nvmlSystemGetDriverVersion"),
            "nvml": nv.query("nvmlSystemGetNVMLVersion"),
            "cuda_driver": f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else None,
            "nvml_gpus": [nv.device_query(i, "nvmlDeviceGetName") for i in range(nv.device_count)],
        }
    finally:
        nv.close()


def capability_table(dev: DeviceInfo) -> dict[str, dict[str, dict[str, str | None]]]:
    """Every toggle value's support on `dev` (trainer.contract.capabilities: one source), and whether slow."""
    return {
        name: {
            str(v).lower() if isinstance(v, bool) else str(v): {
                "unsupported": capabilities.support(name, v, dev),
                "slow": capabilities.slow(name, v, dev),
            }
            for v in values
        }
        for name, values in capabilities.CHOICES.items()
    }


# --- the whole run -----------------------------------------------------------------------------------------


def open_log(path: str | None) -> tuple[IO[str], str]:
    """The log of the checks' processes, opened for writing: at `path`, else a new temporary file."""
    if path is None:
        fd, path = tempfile.mkstemp(prefix="gptop-doctor-", suffix=".log")
        return os.fdopen(fd, "w"), path
    return open(path, "w"), str(path)


def run_doctor(
    requested: str,
    quick: bool = False,
    timeout_scale: float = 1.0,
    *,
    nvml: Any = None,
    progress: Callable[[str], None] = lambda s: None,
    log_path: str | None = None,
) -> tuple[DoctorReport, str, int | None]:
    """Run every path; returns the report, the path of the log of the checks' processes (tracebacks: `log_path`,
    else a temporary file the caller removes), and the exit code a stop asked for (Ctrl-C: 130, SIGTERM: 143;
    None when it ran to the end). A stopped doctor's report still holds every path that finished: the paths it
    did not reach are skipped, saying so, since a long run on a GPU is worth keeping for a bug report even when
    a timeout ends it. A device this machine lacks is a ConfigError (bad input), its temporary log removed."""
    temporary = log_path is None
    log_file, log_path = open_log(log_path)
    where = "the checks' log (--log FILE keeps it)" if temporary else log_path
    detected: dict[str, Any] = {}
    results: dict[str, CheckResult] = {}
    stopped: int | None = None
    dev: DeviceInfo | None = None  # decoded once, from the detection line

    def on_line(record: dict[str, Any]) -> None:
        nonlocal dev
        if record.get("kind") == Line.DETECT:
            detected.update(record)
            dev = DeviceInfo.from_dict(record["device"]) if record.get("device") else None
            progress(describe_detection(record))
        elif record.get("kind") == Line.CHECK:
            r = CheckResult.from_dict(record["result"])
            results[r.name] = r
            progress(format_row(r))

    code: int | None = None
    with log_file as log:
        try:
            code = trainer_side(requested, quick, timeout_scale, log, on_line)
            for r in [] if detected.get("refused") else gptop_side(dev, requested, quick, log, nvml=nvml):
                results[r.name] = r
                progress(format_row(r))
        except KeyboardInterrupt:  # the processes are stopped by the finally blocks on the way here
            stopped = 130
        except SystemExit as e:  # SIGTERM (_terminate)
            stopped = e.code if isinstance(e.code, int) else 1
    refused = detected.get("refused")
    if refused and stopped is None:  # a device this machine lacks: bad input, said in one line (exit 2)
        if temporary:
            Path(log_path).unlink(missing_ok=True)
        raise ConfigError(refused["option"], refused["message"])
    for p in PATHS:  # what the trainer's side never reported (stopped, it died, or detection failed)
        if p.name in results:
            continue
        if stopped is not None:
            outcome = Outcome.skip(f"the doctor was stopped (exit code {stopped}) before this path finished")
        else:
            why = detected.get("error") or f"the doctor's trainer process ended early (exit code {code})"
            outcome = Outcome.verdict(False, "not run", f"{why}; see {where}")
        results[p.name] = CheckResult.of(p, outcome, None)
        progress(format_row(results[p.name]))
    machine = dict(detected.get("machine") or {})
    machine.update(nvml_machine(nvml))
    report = DoctorReport(
        requested=requested,
        time=time.time(),
        machine=machine,
        device=dev.to_dict() if dev is not None else None,
        precision_auto=capabilities.auto_precision(dev) if dev is not None else None,
        capabilities=capability_table(dev) if dev is not None else {},
        checks=[results[p.name] for p in PATHS],
        quick=quick,
    )
    return report, log_path, stopped


# --- words ----------------------------------------------------------------------------------------------------


def describe_detection(record: dict[str, Any]) -> str:
    if record.get("error"):
        return f"device: not detected: {record['error']}"
    d, m = record["device"], record.get("machine", {})
    dev = DeviceInfo.from_dict(d)
    if dev.is_cuda:
        where = (
            f"{dev.name} (cuda:{dev.index}, compute capability {'.'.join(map(str, dev.capability or ()))}, "
            f"{dev.total_memory / 2**30:.1f} GiB)"
        )
    else:
        bf16 = "native bf16" if dev.cpu_bf16_native or dev.cpu_bf16 else "no native bf16 (emulated)"
        where = f"{dev.name} ({dev.cpu_count} cores, {m.get('cpu_isa')}, {bf16}, {dev.total_memory / 2**30:.1f} GiB)"
    soft = (
        f"torch {m.get('torch')}"
        + (f", CUDA {m['torch_cuda']}" if m.get("torch_cuda") else "")
        + (f", cuDNN {m['cudnn']}" if m.get("cudnn") else "")
        + (f", NCCL {m['nccl']}" if m.get("nccl") else "")
    )
    return f"device: {where}; {soft}; --precision auto -> {capabilities.auto_precision(dev)}"


MARK = {Status.PASS: "pass", Status.FAIL: "FAIL", Status.SKIP: "skip"}


def format_row(r: CheckResult) -> str:
    lines = [f"  {MARK[r.status]:4}  {r.name:34} {r.observed}"]
    if r.status is not Status.SKIP:
        lines.append(f"        {'':34} expected: {r.expected}")
    if r.reason:
        lines.append(f"        {'':34} {'why' if r.status is Status.FAIL else 'skipped'}: {r.reason}")
    return "\n".join(lines)


def format_report(report: DoctorReport, log_path: str | None) -> str:
    """The record in words; `log_path`: where the checks' log was kept (None: not kept)."""
    m = report.machine
    out = ["gptop doctor" + (" --quick" if report.quick else "") + f" on {m.get('host', '?')}"]
    if report.device is not None:
        out.append(describe_detection({"device": report.device, "machine": m}))
    if m.get("driver"):
        out.append(f"driver {m['driver']}, NVML {m.get('nvml')}, CUDA driver {m.get('cuda_driver')}")
    libs = m.get("libraries") or {}
    if libs:
        out.append("libraries: " + ", ".join(f"{k} {v or 'missing'}" for k, v in libs.items()))
    if report.capabilities:
        out.append("toggle values on this device (trainer.contract.capabilities):")
        for name, values in report.capabilities.items():
            ok = [v for v, c in values.items() if c["unsupported"] is None and c["slow"] is None]
            slow = [f"{v} (slow: {c['slow']})" for v, c in values.items() if c["unsupported"] is None and c["slow"]]
            no = [f"{v} ({c['unsupported']})" for v, c in values.items() if c["unsupported"]]
            out.append(
                f"  {name}: {', '.join(ok) or '-'}"
                + (f"; slow: {'; '.join(slow)}" if slow else "")
                + (f"; refused: {'; '.join(no)}" if no else "")
            )
    out.append("paths:")
    out += [format_row(r) for r in report.checks]
    c = report.counts
    verdict = "every path that applies passed" if report.ok else "a path that applies FAILED"
    out.append(
        f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped: {verdict}"
        + (
            ""
            if report.ok
            else f" (the checks' log: {log_path})"
            if log_path
            else " (the checks' log's end is on stderr; --log FILE keeps it)"
        )
    )
    return "\n".join(out)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # through the finally blocks that stop the doctor's processes


def cmd_doctor(ns: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    as_json = getattr(ns, "json", False)
    live = (
        (lambda s: print(s, file=sys.stderr, flush=True)) if not as_json and sys.stderr.isatty() else (lambda s: None)
    )
    keep = getattr(ns, "log", None)  # where the user asked for the checks' log; else it is removed at the end
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report, log_path, stopped = run_doctor(ns.device, ns.quick, ns.timeout_scale, progress=live, log_path=keep)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        if stopped is not None:  # Ctrl-C or SIGTERM: the paths that finished are still written below
            print("gptop doctor: stopped; the record holds the paths that finished", file=sys.stderr)
        if not report.ok and keep is None:
            show_log_end(log_path)
        record = report.to_dict()
        problems = validate_report(record)
        if as_json:
            out.write(json.dumps(record, default=str) + "\n")  # one line: --json's one meaning
        else:
            out.write(format_report(report, keep) + "\n")
    finally:
        if keep is None:
            Path(log_path).unlink(missing_ok=True)
    if problems:  # our own record must match its schema: say so, never silently
        print("gptop doctor: the record does not match its schema: " + "; ".join(problems[:5]), file=sys.stderr)
        return 1
    if stopped is not None:
        return stopped
    return exit_code(report.checks)


LOG_END_LINES = 40  # of a failed doctor's log, shown when it is not kept


def show_log_end(path: str, lines: int = LOG_END_LINES) -> None:
    """The end of the checks' log on stderr (their tracebacks), before the temporary file is removed."""
    try:
        text = Path(path).read_text(errors="replace").rstrip()
    except OSError:
        return
    if text:
        tail = "\n".join(text.splitlines()[-lines:])
        print(f"gptop doctor: the checks' log ends (--log FILE keeps it whole):\n{tail}", file=sys.stderr)


# --- docs/verified.md's "What was verified where" ------------------------------------------------------------

README_BEGIN = "<!-- doctor-paths: generated by `python -m gptop.doctor --readme` -->"
README_END = "<!-- /doctor-paths -->"
RECORDS = Path(__file__).resolve().parent.parent / "docs" / "doctor"


def load_records(folder: Path = RECORDS) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) of every doctor record committed under docs/doctor/, valid ones only."""
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not validate_report(record):
            out.append((path.name, record))
    return out


def readme_table(records: list[tuple[str, dict[str, Any]]] | None = None) -> str:
    """docs/verified.md's table: every path of PATHS, and what each committed record says of it (links
    relative to docs/)."""
    records = load_records() if records is None else records
    heads = [f"[{_machine_name(r)}](doctor/{name})" for name, r in records]
    lines = [
        README_BEGIN,
        "",
        "| path | " + " | ".join(heads) + " |" if heads else "| path |",
        "|---|" + "---|" * len(heads),
    ]
    for p in PATHS:
        cells = []
        for _, r in records:
            got = next((c for c in r["checks"] if c["name"] == p.name), None)
            if got is None:
                cells.append("not in this record")
            elif got["status"] == Status.SKIP:
                cells.append(
                    "skipped ("
                    + (
                        "quick"
                        if "--quick" in (got["reason"] or "")
                        else "n/a here"
                        if "path; the doctor ran on" in (got["reason"] or "")
                        else "not available"
                    )
                    + ")"
                )
            else:
                cells.append("**passed**" if got["status"] == Status.PASS else "**FAILED**")
        lines.append(f"| {p.title} (`{p.name}`) | " + " | ".join(cells) + " |")
    lines += ["", README_END]
    return "\n".join(lines)


def _machine_name(record: dict[str, Any]) -> str:
    dev = DeviceInfo.from_dict(record["device"]) if record["device"] else None
    torch_version = record["machine"].get("torch", "?")
    if dev is None:
        return f"device not detected (torch {torch_version})"
    return f"{dev.name} ({'GPU' if dev.is_cuda else 'CPU'}, torch {torch_version})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptop.doctor")
    parser.add_argument(
        "--readme", action="store_true", help="print the 'What was verified where' table of docs/verified.md"
    )
    parser.add_argument("--schema", action="store_true", help="print the record's JSON Schema")
    ns = parser.parse_args(argv)
    if ns.schema:
        print(json.dumps(REPORT_SCHEMA, indent=1))
        return 0
    if ns.readme:
        print(readme_table())
        return 0
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
