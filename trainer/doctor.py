"""`python -m trainer.doctor`: the trainer's side of `gptop doctor` (gptop starts it; it needs torch).

It detects the device, then calls each trainer-side path's check (trainer.contract.doctor.PATHS: the
function in the module that owns the path) in a child process of its own, forked from this process where no
check will start CUDA (else spawned: `start_method`): every child starts CUDA afresh, a crash or a CUDA
error stays in its child, and a child that outlives its path's timeout is killed and the path failed. Each result is one
JSON line on stdout, as it completes:

    {"kind": "detect", "device": {...DeviceInfo...}, "machine": {...}, "error": null}
                      (a device this machine lacks: "refused": {"option", "message"}, and exit code 2)
    {"kind": "check", "result": {...CheckResult...}}
    {"kind": "done"}

`--load SECONDS` instead keeps the GPU busy with matmuls (gptop's NVML checks sample it meanwhile): it
prints {"kind": "busy"} once the work runs, and stops after SECONDS or when its stdin closes.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import multiprocessing
import os
import platform
import signal
import socket
import sys
import time
import traceback
from importlib import metadata
from typing import Any

from . import process_costs
from .contract.config import ConfigError
from .contract.doctor import PATHS, CheckResult, DevicePath, Line, Outcome, Status

EXIT_USAGE = 2  # the device asked for is not on this machine
LIBRARIES = (
    "transformers",
    "peft",
    "torchao",
    "triton",
    "bitsandbytes",
    "nvidia-ml-py",
    "optuna",
    "textual",
    "tomli-w",
    "accelerate",
)


def emit(kind: Line, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind.value, **fields}, default=str) + "\n")
    sys.stdout.flush()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def detect_machine(requested: str) -> dict[str, Any]:
    """The device a run given `--device requested` gets, and the software around it (in a child: it
    initializes CUDA)."""
    import torch

    from .contract.device import cpu_name
    from .device_probe import compiler_missing, detect

    machine: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "libraries": {name: _version(name) for name in LIBRARIES},
    }
    dev = detect(requested)
    machine["compiler_missing"] = compiler_missing(dev.type)
    if torch.cuda.is_available():
        machine["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        machine["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        try:
            machine["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # a build without NCCL
            machine["nccl"] = None
    return {"device": dev.to_dict(), "machine": machine}


def _owner(p: DevicePath) -> Any:
    module, _, function = p.owner.partition(":")
    return getattr(importlib.import_module(module), function)


class ChildEnd(enum.StrEnum):
    """How a check's child process ended, as `run_in_child` says it. The child sends the word, not the member:
    run as `python -m trainer.doctor`, this class lives in `__main__`, which a spawned child names otherwise."""

    OK = "ok"  # it reported what the check returned
    REFUSED = "refused"  # the detection refused the device asked for (ConfigError): {"option", "message"}
    ERROR = "error"  # the check raised: the message
    DIED = "died"  # the process died before it reported
    TIMEOUT = "timeout"  # killed at the check's time limit


def _child(fn_name: str, requested: str, quick: bool, conn: Any) -> None:
    """In the forked child: run one path's check (or the detection) and send back what it returned."""
    from .dist import die_with_parent

    die_with_parent()  # never outlive the runner (killed, or its gptop gone)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if _THREADS:
            import torch

            torch.set_num_threads(_THREADS)
        if fn_name == "detect":
            try:
                conn.send((ChildEnd.OK.value, detect_machine(requested)))
            except ConfigError as e:  # a device this machine lacks: bad input, not a failed path
                conn.send((ChildEnd.REFUSED.value, {"option": e.option, "message": e.message}))
            return
        from .device_probe import detect

        p = next(p for p in PATHS if p.name == fn_name)
        outcome = _owner(p)(detect(requested), quick, **dict(p.args))
        conn.send(
            (
                ChildEnd.OK.value,
                {
                    "status": outcome.status.value,
                    "observed": outcome.observed,
                    "reason": outcome.reason,
                    "data": json.loads(json.dumps(outcome.data, default=str)),
                },
            )
        )
    except BaseException as e:  # the check's own failure is its result
        traceback.print_exc(file=sys.stderr)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        conn.send((ChildEnd.ERROR.value, f"{type(e).__name__}: {first}"[:500]))
    finally:
        conn.close()


def run_in_child(name: str, requested: str, quick: bool, timeout_s: float) -> tuple[ChildEnd, Any]:
    """(OK, payload) or (ERROR, message) from the child, else (DIED or TIMEOUT, message)."""
    ctx = multiprocessing.get_context(start_method(requested))
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, requested, quick, send), name=f"gptop-doctor-{name}")
    proc.start()
    _ACTIVE.append(proc)
    send.close()
    got: tuple[str, Any] | None = None
    if receive.poll(timeout_s):
        try:
            got = receive.recv()
        except EOFError:
            got = None
    proc.join(timeout=5.0 if got is not None else 0.1)
    _ACTIVE.remove(proc)
    if proc.is_alive():
        proc.kill()
        proc.join()
        if got is None:
            return ChildEnd.TIMEOUT, f"did not finish within {timeout_s:.0f} s (killed)"
    if got is None:
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return ChildEnd.DIED, f"the check's process died ({how}) before it reported"
    return ChildEnd(got[0]), got[1]


_THREADS = 0  # torch's intra-op threads before preload held this process to one


def start_method(requested: str) -> str:
    """How a check's child starts: forked (torch and the owners' modules already imported: fast) where no child
    will start CUDA, else spawned. A forked child cannot start CUDA ("Cannot re-initialize CUDA in forked
    subprocess") once its parent has initialized CUDA, and also once the parent only asked CUDA about its
    devices (`torch.cuda.is_available()`, `device_count()`: an import such as torchao's does), although
    `torch.cuda.is_initialized()` stays False then; so a run that may use a GPU spawns its checks."""
    import torch

    if torch.cuda.is_initialized():
        return "spawn"
    return "fork" if requested == "cpu" or not torch.cuda.is_available() else "spawn"


def preload() -> None:
    """Import torch and every owner's module once, here, so each forked child starts with them, and warm what
    torch imports lazily on first use (an optimizer step, torch.save: seconds each). Nothing here touches
    CUDA, and this process computes on one thread (no OpenMP pool exists to be forked); each child gets the
    threads back."""
    global _THREADS
    import io

    import torch

    for p in PATHS:
        if not p.in_gptop:
            importlib.import_module(p.owner.partition(":")[0])
    _THREADS = torch.get_num_threads()
    torch.set_num_threads(1)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save(m.state_dict(), io.BytesIO())


def run_checks(requested: str, quick: bool, only: set[str] | None, timeout_scale: float) -> int:
    preload()
    kind, payload = run_in_child("detect", requested, quick, 120.0 * timeout_scale)
    if kind == ChildEnd.REFUSED:  # gptop says it in one line and exits 2, as for any bad input
        emit(Line.DETECT, device=None, machine={}, error=f"{payload['option']}: {payload['message']}", refused=payload)
        emit(Line.DONE)
        return EXIT_USAGE
    if kind != ChildEnd.OK:
        emit(Line.DETECT, device=None, machine={}, error=payload)
        emit(Line.DONE)
        return 1
    emit(Line.DETECT, device=payload["device"], machine=payload["machine"], error=None)
    device_type = payload["device"]["type"]
    for p in PATHS:
        if p.in_gptop or (only is not None and p.name not in only):
            continue
        t0 = time.monotonic()
        if not p.applies_to(device_type):
            outcome = Outcome.skip(
                f"a {p.where.value.upper()} path; the doctor ran on {device_type} "
                f"(gptop doctor --device {p.where.value} on a machine that has one)"
            )
        elif quick and not p.quick:
            outcome = Outcome.skip("left out by --quick")
        else:
            kind, got = run_in_child(p.name, requested, quick, p.timeout_s * timeout_scale)
            if kind == ChildEnd.OK:
                outcome = Outcome(Status(got["status"]), got["observed"], got["reason"], got["data"])
            else:
                outcome = Outcome(Status.FAIL, got, got)
        seconds = round(time.monotonic() - t0, 3)
        emit(Line.CHECK, result=CheckResult.of(p, outcome, seconds).to_dict())
    emit(Line.DONE)
    return 0


def burn(requested: str, seconds: float) -> int:
    """Keep the device busy with matmuls for `seconds` (or until stdin closes): the workload gptop's NVML
    checks sample."""
    import select

    import torch

    from .device_probe import detect

    dev = detect(requested)
    device = dev.torch_device
    if dev.is_cuda:
        torch.cuda.set_device(device)
    n = 8192 if dev.is_cuda else 256
    a = torch.randn(n, n, device=device)
    b = a @ a
    if dev.is_cuda:
        torch.cuda.synchronize(device)
    emit(Line.BUSY)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):
            b = (a @ b) * (1.0 / n)
        if dev.is_cuda:
            torch.cuda.synchronize(device)
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if ready and not sys.stdin.read(1):  # gptop closed our stdin: stop now
            break
    emit(Line.IDLE)
    return 0


_ACTIVE: list[Any] = []  # the check's child process while one runs


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM / SIGINT: kill the running check's child, then exit (no process is left behind)."""
    for proc in list(_ACTIVE):
        proc.kill()
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.doctor", description="The trainer's side of gptop doctor (JSON lines on stdout)."
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--quick", action="store_true", help="only the quick paths")
    parser.add_argument("--only", default=None, metavar="NAMES", help="comma-separated path names")
    parser.add_argument(
        "--timeout-scale", type=float, default=1.0, metavar="F", help="multiply every path's timeout (default: 1)"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        metavar="SECONDS",
        help="keep the device busy for SECONDS instead of checking",
    )
    ns = parser.parse_args(argv)
    from .dist import die_with_parent

    die_with_parent()  # gptop gone (killed, or its timeout): stop too
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if ns.load is not None:
        return burn(ns.device, ns.load)
    only = set(ns.only.split(",")) if ns.only else None
    return run_checks(ns.device, ns.quick, only, ns.timeout_scale)


if __name__ == "__main__":
    sys.exit(process_costs.set_exit_code(main()))  # then no interpreter teardown
