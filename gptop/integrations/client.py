"""One training process's end of gptop's protocol, driven by the probe and the callbacks (the torch side).

A `Client` is the trainer's loop instrumentation without the trainer's loop: the same channel
(trainer.channel: events.jsonl and the socket, commands back, SIGTERM/SIGINT as a graceful stop, SIGUSR1 a
checkpoint), the same command agreement across ranks (trainer.commands, over a gloo group beside the
program's own process group), the same step timer (trainer.timing: CUDA events on a GPU, read back only
when the interval's values are, monotonic clocks on the CPU), the same profiler windows (trainer.profiler)
and memory meter (trainer.memory; one that never resets the process's peak, so `mem_bytes` is the peak the
program's own reading gives). It emits the same typed events: a hello, a `progress` event every step,
a `step` event every log interval (means over the interval, `phases_ms` with `other` = what the phases
leave of the step), checkpoints, errors and `done`.

Its integrations only say where a step and its phases begin and end (`begin_step`, `enter`/`leave` or
`phase`, `end_step`), what was logged (`log`) and when to report (`flush`); they turn `should_checkpoint`
and `should_stop` into their framework's actions. gptop's own trainer could drive one the same way.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, TypeAlias

import torch

from trainer.channel import Channel
from trainer.commands import Commands
from trainer.contract.client import ClientEnv, ClientKind
from trainer.contract.device import DeviceInfo
from trainer.contract.events import TUNER_RESTART
from trainer.contract.rundir import RunDir
from trainer.contract.states import ErrorKind, WarningKind
from trainer.timing import TIMED, interval_means, make_timer

from .precision import model_precision

TUNABLE_KINDS = (ClientKind.TRANSFORMERS,)  # the clients that take gptop tune's toggles (tuned_args)
SIGNAL_STOPS = ("SIGINT", "SIGTERM")  # a stop by signal has its name for a reason (trainer.channel): gptop sends
# one with each of its stop commands, so it says nothing of who stopped
DEFAULT_LOG_EVERY = 10  # the trainer's --log-every default, when neither gptop nor the program says
# `progress` events at most this often: a loop of millisecond steps would otherwise spend more on them than on
# its work, and the dashboard redraws its step counter once a second (a step event always comes at a log step)
PROGRESS_MIN_S = 0.05
# What a step event's `loss`, `lr` or `grad_norm` may be given as: a tensor is read back only at a log step.
Value: TypeAlias = float | int | torch.Tensor


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process: torch.distributed's when it is initialized, else
    torchrun's environment, else one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def describe_model(
    model: torch.nn.Module | None, *, seq_len: int | None = None, flops_per_token: float | None = None
) -> dict[str, Any]:
    """A hello event's `model` for a module built by the user: its class, parameter counts and FLOPs per token.

    FLOPs per token (training, forward + backward) when not given: a transformers model with its config and
    `seq_len` known gets the built-in families' formula (trainer.flops: 6 per active non-embedding parameter,
    4 per frozen one, plus the attention term); any other module 6 per trainable and 4 per frozen parameter
    outside its embedding lookups, without an attention term (it cannot be known from the parameters)."""
    if model is None:
        return {"flops_per_token": int(flops_per_token) if flops_per_token else None}
    from trainer import flops as F

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    cfg = getattr(model, "config", None)
    counts = None
    if cfg is not None and callable(getattr(model, "get_input_embeddings", None)):
        from trainer.models import count_params, training_flops_per_token

        try:
            counts = count_params(model, cfg)
            if flops_per_token is None and seq_len:
                flops_per_token = training_flops_per_token(model, cfg, seq_len)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            counts = None  # a config without the attention shape: the generic count below
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - linear  # tied: a head
    embedding = sum(p.numel() for p in params if id(p) in lookups)
    if flops_per_token is None:
        train = sum(p.numel() for p in params if p.requires_grad and id(p) not in lookups)
        frozen = sum(p.numel() for p in params if not p.requires_grad and id(p) not in lookups)
        flops_per_token = F.flops_per_token(train, 0, 0, 0, 0, frozen_params=frozen)
    return {
        "family": type(model).__name__,
        "total_params": total,
        "active_params": counts["active"] if counts else total,
        "embedding_params": counts["embedding"] if counts else embedding,
        "trainable_params": trainable,
        "flops_per_token": int(flops_per_token) if flops_per_token else None,
    }


def module_device(model: torch.nn.Module | None) -> torch.device:
    p = next(iter(model.parameters()), None) if model is not None else None
    return p.device if p is not None else torch.device("cpu")


class Client:
    """The protocol's client in one process (see the module docstring). Start it with `Client.connect`, which
    returns None outside gptop."""

    _loss: list[Value]  # the current log interval's values (set by _interval_reset)
    _grad: list[Value]
    _lr: Value | None

    def __init__(
        self,
        env: ClientEnv,
        kind: ClientKind,
        *,
        device: torch.device,
        log_every: int | None = None,
        tokens_per_step: int | None = None,
        max_steps: int | None = None,
        precision: str = "fp32",
        optimizer: Any = None,
        reduce_loss: bool = True,
        start_step: int = 0,
        signals: bool = True,
    ):
        """`signals`: take SIGTERM/SIGINT (a graceful stop) and SIGUSR1 (a checkpoint) while connected, from
        the main thread only (Python's rule); the previous handlers come back at `close`."""
        self.env, self.kind = env, kind
        self.rank, self.world, self.local_rank = env_world()
        self.device = device
        self.log_every = env.log_every or log_every or DEFAULT_LOG_EVERY
        self.tokens_per_step = tokens_per_step  # this process's tokens per step
        self.max_steps = max_steps
        self.flops_per_token: float | None = None  # set by `hello`
        self.precision = precision
        self.start_step = start_step
        self.said_hello = False
        self.optimizer = optimizer
        self.reduce_loss = reduce_loss  # mean the logged loss over the ranks (a plain loop's)
        self.step = start_step  # the step begun last (the current one while in_step)
        self.done_step = start_step  # the step finished last: what events report
        # a framework restores its step, not a token count: gptop continues the run's count from this one
        self.tokens = self.start_tokens = start_step * tokens_per_step * self.world if tokens_per_step else 0
        self.should_checkpoint = False
        self.should_stop = False
        self.stop_reason: str | None = None
        self.stop_words: set[str] = set()  # every stop's reason (a signal's name, gptop's words)
        self.finished = False
        self.in_step = False
        self._open: dict[str, AbstractContextManager] = {}
        self._step_tokens = 0
        self._started = self._last_end = time.perf_counter()
        self._last_progress = -math.inf
        self._crashed = False
        self._mfu_dropped = False
        self.channel = Channel(RunDir(env.run_dir).events(self.rank), env.channel, rank=self.rank)
        self.channel.started()  # a stop is always a request the program acts on at a step boundary
        self.commands = Commands(self.channel, self.rank, self._agreement())
        self.timer = make_timer(device, True)
        from trainer.memory import make_meter
        from trainer.profiler import StepProfiler

        self.meter = make_meter(device, reset_process_peak=False)  # the program's own peak readings stay its own
        self.profiler = StepProfiler(
            RunDir(env.run_dir).profiles, self.rank, device.type == "cuda", None, on_written=self._profile_written
        )
        self.dev = self._device_info(device)
        self.peak_flops, self.peak_source = self._peak(precision)
        self._interval_reset()
        self._old_handlers: dict[int, Any] = {}
        if signals and threading.current_thread() is threading.main_thread():
            self._old_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
            self.channel.install_signal_handlers()
        self._old_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.close)

    def hello(self, model: dict[str, Any], *, config: dict[str, dict[str, Any]] | None = None, **fields: Any) -> None:
        """The hello event (once, from each node's first rank): what runs where (`model`: describe_model's),
        before the first step is reported. The FLOPs per token it gives are the MFU numerator. `config`:
        sections of the run's configuration the integration knows (a Trainer's toggles, batch and sequence
        length, which the tuner starts from), over the client's own; `fields`: more of the hello's fields
        (micro_batch, accumulation, tunable)."""
        if self.said_hello:
            return
        self.said_hello = True
        self.flops_per_token = model.get("flops_per_token")
        if self.local_rank != 0:
            return
        config_: dict[str, dict[str, Any]] = {
            "log": {"log_every": self.log_every},
            "toggles": {"precision": self.precision},
        }
        if self.max_steps:
            config_["optim"] = {"max_steps": self.max_steps}
        for section, values in (config or {}).items():
            config_[section] = {**config_.get(section, {}), **values}
        config = config_
        tps = self.tokens_per_step
        self.channel.emit(
            "hello",
            pid=os.getpid(),
            world_size=self.world,
            config=config,
            device=self.dev.to_dict(),
            model=model,
            tokens_per_step=tps * self.world if tps else None,
            peak_flops=self.peak_flops,
            peak_source=self.peak_source,
            start_step=self.start_step,
            start_tokens=self.start_tokens,
            torch=torch.__version__,
            client=self.kind.value,
            **fields,
        )

    @classmethod
    def connect(cls, env: ClientEnv | None, kind: ClientKind, **kwargs: Any) -> "Client | None":
        """A client for this process if gptop started it (`env`), else None. A channel that cannot be reached
        (gptop is gone) is said once on stderr and the program trains on without gptop: a client never ends
        a training run for its own sake."""
        if env is None:
            return None
        try:
            client = cls(env, kind, **kwargs)
        except OSError as e:
            print(
                f"[gptop] cannot reach gptop at {env.channel} ({e}); training on without it",
                file=sys.stderr,
                flush=True,
            )
            return None
        if env.tune and kind not in TUNABLE_KINDS:
            # gptop tune -- CMD hands toggles to a transformers.Trainer script only: said before the first step
            client.refuse(
                f"gptop tune: this program's gptop client ({kind.value}) takes no toggles; gptop tune "
                f"-- CMD tunes a transformers.Trainer script (GptopCallback, tuned_args, "
                f"resume_checkpoint); run this one with gptop run"
            )
            client.close()
            raise SystemExit(1)
        return client

    def set_precision(self, precision: str) -> None:
        """The precision (the MFU peak's column) once known, before the hello that reports it."""
        if precision != self.precision and not self.said_hello:
            self.precision = precision
            self.peak_flops, self.peak_source = self._peak(precision)

    # ------------------------------------------------------------------ setup
    def _agreement(self) -> Callable[[list[int]], list[int]] | None:
        """Several ranks act on a command at the same step (trainer.commands): a MAX over a gloo group."""
        import torch.distributed as dist

        if self.world <= 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        from trainer.dist import control_group, host_max

        ctrl = control_group()
        return lambda values: host_max(values, ctrl)

    @staticmethod
    def _device_info(device: torch.device) -> DeviceInfo:
        from trainer.contract.config import ConfigError
        from trainer.device_probe import detect

        try:
            return detect(str(device) if device.type == "cuda" and device.index is not None else device.type)
        except ConfigError:
            return DeviceInfo(type=device.type, name=str(device))

    def _peak(self, precision: str) -> tuple[float | None, str | None]:
        """The MFU denominator per process (trainer.flops: the GPU table, or the CPU's measured peak)."""
        from trainer.flops import peak

        try:
            p = peak(self.dev, precision, procs=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        except Exception as e:  # never fail the user's run for a figure: MFU is then n/a
            self.channel.emit(
                "warning", message=f"no MFU: the device's peak could not be found ({e})", kind=WarningKind.PEAK_FLOPS
            )
            return None, None
        return p.flops, p.source

    # ------------------------------------------------------------------ steps
    def begin_step(self, step: int) -> None:
        """Step `step` (optimizer steps, numbered from 1) begins."""
        self.step = step
        self.in_step = True
        self._step_tokens = 0
        self.profiler.step_begin(step, self.timer)
        self.timer.begin_step(step)

    def restart_step(self) -> None:
        """The step that has begun starts again from now (a framework's logging, evaluation or saving ran after
        its boundary: that is not the next step's data wait)."""
        if self.in_step:
            for name in list(self._open):
                self.leave(name)
            self.timer.begin_step(self.step)

    def abandon_step(self) -> None:
        """The step that has begun will not be taken (the training ended, or the step raised): not reported."""
        for name in list(self._open):
            self.leave(name)
        self.in_step = False

    def phase(self, name: str) -> AbstractContextManager:
        """A timed phase of the current step (data, forward, backward, optimizer), as a context manager."""
        return self.timer.phase(name)

    def enter(self, name: str) -> None:
        """Open phase `name` (from a hook); `leave` closes it. Outside a step, or already open: nothing."""
        if self.in_step and name not in self._open:
            cm = self.timer.phase(name)
            cm.__enter__()
            self._open[name] = cm

    def leave(self, name: str) -> None:
        cm = self._open.pop(name, None)
        if cm is not None:
            cm.__exit__(None, None, None)

    def is_open(self, name: str) -> bool:
        return name in self._open

    def add_tokens(self, n: int) -> None:
        """Tokens this process trained on in the current step (from a batch's shape); summed over micro-batches."""
        self._step_tokens += int(n)

    def end_step(self) -> None:
        """The step is done: its time, tokens and the `progress` event. Then `poll` for gptop's commands, and
        `flush` at a log step."""
        for name in list(self._open):
            self.leave(name)
        self.timer.end_step()
        self.profiler.step_end(self.step)
        self.in_step = False
        self.done_step = self.step
        tokens = self._step_tokens or self.tokens_per_step or 0
        self.tokens += tokens * self.world
        self._n += 1
        self._n_tokens += tokens * self.world
        now = time.perf_counter()
        step_ms, self._last_end = (now - self._last_end) * 1e3, now
        if self.rank == 0 and now - self._last_progress >= PROGRESS_MIN_S:
            self._last_progress = now
            self.channel.emit_live("progress", step=self.done_step, tokens=self.tokens, step_ms=step_ms)

    def is_log_step(self, step: int | None = None) -> bool:
        step = self.done_step if step is None else step
        return step % self.log_every == 0 or (self.max_steps is not None and step >= self.max_steps)

    # ------------------------------------------------------------------ values
    def log(self, loss: Value | None = None, lr: Value | None = None, grad_norm: Value | None = None) -> None:
        """Values of the current interval. Tensors stay on the device (no synchronization) until `flush`."""
        if loss is not None:
            self._loss.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        if grad_norm is not None:
            self._grad.append(grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else float(grad_norm))
        if lr is not None:
            self._lr = lr

    def _interval_reset(self) -> None:
        self._n = self._n_tokens = 0
        self._loss = []
        self._grad = []
        self._lr = None
        self._t0 = time.perf_counter()
        self.meter.reset_peak()

    def _mean(self, values: list[Value], reduce: bool) -> tuple[float | None, bool]:
        """The mean of an interval's values (over the ranks too with `reduce`), and whether the device was read."""
        tensors = [v.reshape(()).double() for v in values if isinstance(v, torch.Tensor)]
        host = sum(float(v) for v in values if not isinstance(v, torch.Tensor))
        if not reduce and not tensors:
            mean = host / len(values) if values else None  # the framework read them back already
            return (mean if mean is not None and math.isfinite(mean) else None), False
        total = torch.stack(tensors).sum() if tensors else torch.zeros((), dtype=torch.float64, device=self.device)
        pair = torch.stack([total + host, torch.full((), float(len(values)), dtype=torch.float64, device=total.device)])
        if reduce:
            import torch.distributed as dist

            dist.all_reduce(pair, op=dist.ReduceOp.SUM)
        s, n = pair.tolist()  # the one read-back of the interval
        return (s / n if n and math.isfinite(s / n) else None), True

    def flush(self) -> None:
        """The step event of the interval: values read back (one synchronization), times collected."""
        n = self._n
        if n == 0:
            return
        import torch.distributed as dist

        reduce = self.reduce_loss and self.world > 1 and dist.is_available() and dist.is_initialized()
        loss, synced = self._mean(self._loss, reduce)
        grad_norm, synced_g = self._mean(self._grad, False)
        lr = self._lr
        if lr is None and self.optimizer is not None:
            lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            lr, synced = float(lr.item()), True
        if self.device.type == "cuda" and not (synced or synced_g):
            torch.cuda.synchronize(self.device)  # the timer's events are read now: they must be done
        step_ms, phases, idle = interval_means(self.timer.collect())
        wall = time.perf_counter() - self._t0
        tokens_per_s = self._n_tokens / wall if wall > 0 and self._n_tokens else None
        fields: dict[str, Any] = dict(
            step=self.done_step,
            tokens=self.tokens,
            loss=loss,
            lr=None if lr is None else float(lr),
            grad_norm=grad_norm,
            step_ms=step_ms if step_ms is not None else wall * 1e3 / n,
            phases_ms=phases,
            tokens_per_s=tokens_per_s,
            mfu=self._mfu(tokens_per_s),
            mem_bytes=self.meter.peak(),
            interval_steps=n,
            wall_ms=wall * 1e3 / n,
        )
        if idle is not None:
            fields["gpu_idle_ms"] = idle
        self.channel.emit("step", **fields)
        self._interval_reset()

    def _mfu(self, tokens_per_s: float | None) -> float | None:
        from trainer.flops import mfu

        if self._mfu_dropped or not self.flops_per_token or not self.peak_flops:
            return None
        got = mfu(tokens_per_s, self.flops_per_token, self.peak_flops * self.world)
        if got is not None and got > 1.0:  # the FLOPs per token or the peak is wrong: say so once, report none
            self._mfu_dropped = True
            self.channel.emit(
                "warning",
                kind=WarningKind.PEAK_FLOPS,
                message=(
                    f"MFU would be {got:.2f} (> 1): {self.flops_per_token:,.0f} FLOPs per token at "
                    f"{self.peak_flops / 1e9:,.1f} GFLOP/s per process cannot both be right; MFU is not reported for "
                    f"the rest of this run (give flops_per_token= if the count is wrong)"
                ),
            )
            return None
        return got

    # ------------------------------------------------------------------ commands
    def poll(self) -> None:
        """gptop's commands at this step boundary, the same on every rank: they set `should_checkpoint` and
        `should_stop`, start a profiler window at the next step, or change the log interval."""
        if self.channel.write_error is not None and not self.should_stop:
            self.should_stop = True  # events.jsonl cannot be written (a full disk): stop with a checkpoint
            self.stop_reason = f"events could not be written: {self.channel.write_error}"
            self.channel.emit("error", kind=ErrorKind.DISK, message=self.stop_reason, step=self.done_step)
        d = self.commands.poll()
        if d.checkpoint:
            self.should_checkpoint = True
        # the tuner's words win over a signal's name: its stop comes as a command and SIGINT, in either order
        if d.stop and (not self.should_stop or d.stop == TUNER_RESTART):
            self.should_stop, self.stop_reason = True, d.stop
        if d.stop:
            self.stop_words.add(d.stop)
        if d.profile_steps:
            self.profiler.request(self.done_step + 1, d.profile_steps)
        if d.log_every:
            self.log_every = d.log_every

    def checkpointed(
        self,
        path: str | os.PathLike,
        *,
        seconds: float | None = None,
        reason: str | None = None,
        step: int | None = None,
    ) -> None:
        """The program wrote a checkpoint at `path` (its own format): a checkpoint event, and
        `should_checkpoint` is cleared."""
        if reason is None:
            reason = "stop" if self.should_stop else "requested" if self.should_checkpoint else "interval"
        self.should_checkpoint = False
        if self.rank == 0:
            self.channel.emit(
                "checkpoint",
                step=self.done_step if step is None else step,
                path=os.path.abspath(os.fspath(path)),
                seconds=seconds,
                reason=reason,
                tokens=self.tokens,
            )

    @property
    def crashed(self) -> bool:
        """The program failed (an error event was sent): nothing more is reported as done."""
        return self._crashed

    @property
    def restarting(self) -> bool:
        """gptop stops this process to start the program again (a tuner's switch): its work is not over. Any
        other stop said in words (yours, gptop gone) ends the run: then it is."""
        others = self.stop_words - {TUNER_RESTART, *SIGNAL_STOPS}
        return self.should_stop and TUNER_RESTART in self.stop_words and not others

    def warn(self, message: str, kind: str | None = None) -> None:
        self.channel.emit("warning", message=message, kind=kind)

    # ------------------------------------------------------------------ the end
    def error(self, e: BaseException) -> None:
        """The program failed with `e`: an error event (oom or crash) with its first line."""
        if self._crashed or isinstance(e, (KeyboardInterrupt, SystemExit)):
            return
        self._crashed = True
        kind = ErrorKind.OOM if isinstance(e, torch.OutOfMemoryError) else ErrorKind.CRASH
        first = str(e).splitlines()[0] if str(e) else ""
        self.channel.emit(
            "error", kind=kind, message=f"{type(e).__name__}: {first}".rstrip(": "), step=self.done_step, exit_code=1
        )

    def refuse(self, message: str) -> None:
        """The program cannot run the way gptop asked (a `gptop tune` of a script that does not take toggles):
        a `config` error event before the first step, which gptop reports in one line with exit 2. The caller
        ends the program (exit code 1)."""
        if self._crashed:
            return
        self._crashed = True
        self.channel.emit("error", kind=ErrorKind.CONFIG, message=message, step=self.done_step, exit_code=1)

    def _excepthook(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            self.error(value)
        finally:
            self._old_excepthook(kind, value, tb)

    def done(self, reason: str | None = None) -> None:
        """The training is over: `done` with why (`max_steps` when it trained to its end), once."""
        if self.finished or self._crashed:
            return
        self.finished = True
        if self._n:
            self.flush()
        if reason is None:
            reason = self.stop_reason if self.should_stop else "max_steps"
        if self.rank == 0:
            self.channel.emit(
                "done",
                step=self.done_step,
                tokens=self.tokens,
                reason=reason,
                seconds=time.perf_counter() - self._started,
            )

    def close(self) -> None:
        """Done (if not said yet), the profiler window written, the channel closed, the handlers given back."""
        self.done()
        self.profiler.close()
        self.channel.close()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._old_excepthook
        if self._old_handlers and threading.current_thread() is threading.main_thread():
            for s, h in self._old_handlers.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            self._old_handlers = {}
        atexit.unregister(self.close)

    def _profile_written(self, path: Any, first: int, last: int, summary: dict[str, Any] | None) -> None:
        from trainer.profiler import report_written

        report_written(self.channel, path, first, last, summary)


__all__ = ["Client", "DEFAULT_LOG_EVERY", "TIMED", "describe_model", "env_world", "model_precision", "module_device"]
