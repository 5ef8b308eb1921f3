"""One configured run of the trainer, every failure turned into an `error` event and a distinct exit code
(trainer.train's EXIT_*): what `python -m trainer` (trainer.worker_cli) runs."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from . import checkpoint_files as ckpt
from . import dist as D
from .channel import StartupStopped, honour_startup_stop
from .contract import protect
from .contract.atomic import DiskError, disk_error
from .contract.config import ConfigError, TrainConfig
from .contract.events import STOPPED_BEFORE_FIRST_STEP
from .contract.runlock import RunLock
from .contract.states import ErrorKind
from .inductor_cache import artefact_failure
from .memory import enable_expandable_segments
from .train import (
    EXIT_COMPILE,
    EXIT_CONFIG,
    EXIT_CORRUPT_CHECKPOINT,
    EXIT_CRASH,
    EXIT_DISK,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    EXIT_OOM,
    Stop,
    Trainer,
)


def main_run(cfg: TrainConfig, run_lock: RunLock | None = None, created_dirs: list[Path] | None = None) -> int:
    """Run a configured trainer, turning every failure into an `error` event and a distinct exit code.

    `run_lock`: the run directory's lock when the caller took it (trainer.worker_cli); else setup takes it.
    `created_dirs`: the directories the caller made for the run (taking the lock): a refusal before the first
    step removes them, as those setup makes."""
    notice = None
    if cfg.toggles.cuda_allocator == "expandable_segments":
        notice = enable_expandable_segments(os.environ)  # before anything initializes CUDA
    trainer = refused = None
    try:
        trainer = Trainer(cfg)
        if notice:
            trainer.notices.append(notice)
        trainer.run_lock = run_lock
        trainer.created_dirs = list(created_dirs or [])
        trainer.setup()
        return trainer.run()
    except Stop as s:
        return s.code
    except StartupStopped as e:  # nothing to checkpoint before the first step
        return _stop_in_startup(trainer, e)
    except ConfigError as e:
        code = _report(trainer, ErrorKind.CONFIG, str(e), EXIT_CONFIG)
        refused = trainer  # a refusal before the first step leaves nothing of what this trainer created
        return code
    except ckpt.NothingToResume as e:  # known ends: one line; the traceback only into a log file
        return _report(trainer, ErrorKind.NO_CHECKPOINT, str(e), EXIT_NO_CHECKPOINT, traceback=_log_only_traceback())
    except ckpt.CorruptCheckpoint as e:
        return _report(
            trainer, ErrorKind.CORRUPT_CHECKPOINT, str(e), EXIT_CORRUPT_CHECKPOINT, traceback=_log_only_traceback()
        )
    except torch.OutOfMemoryError as e:
        ran = trainer.cfg if trainer is not None else cfg  # with what auto became
        extra = {"toggles": ran.to_dict()["toggles"], "memory": trainer.memory_figures() if trainer else {}}
        return _report(
            trainer,
            ErrorKind.OOM,
            f"out of memory: {str(e).splitlines()[0] if str(e) else ''} -- try a smaller "
            f"--micro-batch, --activation-checkpointing, bf16, --optimizer adamw-8bit or "
            f"--lora R",
            EXIT_OOM,
            **extra,
        )
    except ckpt.PeerSaveFailed as e:
        return _report(trainer, ErrorKind.CRASH, str(e), EXIT_CRASH, lost_peer=True)
    except Exception as e:
        stop = trainer.channel.pending_startup_stop() if trainer is not None and trainer.channel else None
        if stop is not None:  # the stop's raise, turned into a library's error on its way up
            return _stop_in_startup(trainer, StartupStopped(f"{stop}; it surfaced as {type(e).__name__}: {e}"))
        return _report_failure(trainer, cfg, e)
    finally:
        _tear_down(trainer, refused)


def _stop_in_startup(trainer: Trainer | None, e: StartupStopped) -> int:
    """A stop before the first step: a `done` event."""
    honour_startup_stop()  # first: no raise again during this way out
    if trainer is not None:
        trainer.log(f"stopped before the first step ({e})")
        trainer.emit0(
            "done",
            step=trainer.progress.step,
            tokens=trainer.progress.tokens,
            seconds=None,
            reason=STOPPED_BEFORE_FIRST_STEP,
            checkpoint=None,
        )
    return EXIT_OK


def _report_failure(trainer: Trainer | None, cfg: TrainConfig, e: Exception) -> int:
    """An error of no known type, told apart by what it says: a full or read-only disk, a lost peer, a
    torch.compile failure, else a crash. Called while `e` is being handled (its traceback goes with the report)."""
    disk = disk_error(e)
    if disk is not None:  # a full or read-only filesystem: one line, the traceback to the log only
        return _report(
            trainer,
            ErrorKind.DISK,
            _disk_message(trainer, disk),
            EXIT_DISK,
            path=disk.path,
            os_error=disk.strerror,
            free_bytes=disk.free_bytes,
            traceback=_log_only_traceback(),
        )
    if trainer is not None and trainer.world > 1 and D.is_comm_error(e):
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _report(
            trainer,
            ErrorKind.CRASH,
            f"lost contact with another rank, which probably failed (see its error): {first}",
            EXIT_CRASH,
            lost_peer=True,
        )
    if _is_compile_error(e) or artefact_failure(e) is not None:
        own = trainer.own_cache if trainer is not None else None
        again = f" (again in the run's own inductor cache {own.own_dir})" if own is not None and own.used else ""
        return _report(
            trainer,
            ErrorKind.COMPILE,
            f"torch.compile failed ({cfg.toggles.compile}){again}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            EXIT_COMPILE,
            traceback=traceback.format_exc(),
        )
    return _report(trainer, ErrorKind.CRASH, f"{type(e).__name__}: {e}", EXIT_CRASH, traceback=traceback.format_exc())


def _tear_down(trainer: Trainer | None, refused: Trainer | None) -> None:
    """The channel, the process group and the lock, whatever happened; what a refused run created is removed."""
    if trainer is not None and trainer.channel is not None:
        trainer.channel.close()
    if trainer is not None and trainer.group is not None:
        trainer.group.destroy()
    if trainer is not None and trainer.run_lock is not None:
        trainer.run_lock.release()
    if refused is not None and refused.world == 1 and refused.progress.step == 0:
        protect.remove_created(refused.created_dirs)


def _disk_message(trainer: Trainer | None, disk: DiskError) -> str:
    """What failed, and what is safe: the newest checkpoint is intact (atomic writes leave no partial one)."""
    newest = trainer.ckpt.newest if trainer is not None and getattr(trainer, "ckpt", None) is not None else None
    what = "Make it writable" if disk.read_only else "Free some space"
    if newest is None:
        return f"{disk}; no checkpoint was written yet. {what} and start the run again"
    return f"{disk}; the previous checkpoint {newest.name} is intact. {what} and resume with --resume {trainer.run_dir}"


def _log_only_traceback() -> str | None:
    """The traceback of a known end, for trainer.stderr.log (where gptop sends stderr), not a terminal."""
    return None if sys.stderr.isatty() else traceback.format_exc()


_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch")


def _is_compile_error(e: BaseException) -> bool:
    """An error of torch.compile: an exception type of the compiler, one raised inside its code, or a CUDA
    graph's output read after a replay overwrote it (raised wherever the storage is next touched, e.g. by
    autograd or the optimizer, so only its message tells)."""
    if type(e).__module__.startswith(_COMPILER_MODULES):
        return True
    if "CUDAGraphs" in str(e):
        return True
    tb = e.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_COMPILER_MODULES):
            return True
        tb = tb.tb_next
    return False


def _report(trainer: Trainer | None, kind: ErrorKind, message: str, code: int, **extra: Any) -> int:
    tb = extra.pop("traceback", None)
    if tb:
        print(tb, file=sys.stderr, flush=True)
    print(f"[trainer] error ({kind}): {message}", file=sys.stderr, flush=True)
    if trainer is not None and trainer.channel is not None:
        step = trainer.progress.step
        trainer.channel.emit("error", kind=kind, message=message, step=step, exit_code=code, **extra)
    return code
