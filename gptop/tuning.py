"""Tuning on the live run: the session side of the tuner.

The `TuneController` (tuner/) decides; this driver does. It runs in its own
thread, watches the trainer's events through a session hook, and turns the
controller's actions into process restarts:

- a trial starts by a graceful stop of the running trainer (it checkpoints:
  the pre-trial checkpoint) and a restart from that checkpoint with the
  trial's toggles; its steps are real training steps and are kept;
- a failed trial (OOM, NaN, divergence, compile error, crash) is killed if it
  still runs, the checkpoints it wrote are deleted, and the next process
  resumes from the pre-trial checkpoint: the step count and weights are those
  of before the trial;
- the best setting is applied the same way, after a checkpoint, and training
  goes on to --max-steps.

Trial, apply and tuner events are appended to the run's events.jsonl, so a
replay or `gptop report` sees the tuning as it happened.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from trainer import checkpoint as ckpt
from trainer import events as ev
from trainer.config import ConfigError, Toggles, TrainConfig
from trainer.device import DeviceInfo

STEADY = ("done", "prune", "budget", "timeout")
TEST_FAULT_ENV = "GPTOP_TEST_TRIAL_FAULT"     # "N:KIND": inject KIND (nan, oom, crash) into trial N (tests only)


class TuningDriver:
    def __init__(self, session, budget_s: float, space_spec: str | None = None, storage: str | None = None,
                 tune_only: bool = False, trial_log_every: int = 1):
        self.session = session
        self.budget_s = budget_s
        self.space_spec = space_spec
        self.storage = storage
        self.tune_only = tune_only
        self.trial_log_every = trial_log_every
        self.user_log_every = session.cfg.log.log_every
        self.q: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.ctl = None
        self.study = None
        self.thread: threading.Thread | None = None
        self._expect_exit = False
        self._proc_running = False
        self._hello: dict[str, Any] | None = None
        self.last_ckpt: tuple[int, str] | None = None
        self.finished = threading.Event()
        self.error: str | None = None
        fault = os.environ.get(TEST_FAULT_ENV, "")
        self.test_fault = (int(fault.split(":")[0]), fault.split(":")[1]) if ":" in fault else None

    # ------------------------------------------------------------- wiring
    def attach(self) -> "TuningDriver":
        s = self.session
        s.cfg.log.log_every = min(self.user_log_every, self.trial_log_every)
        s.hooks.append(self._on_event)
        s.on_trainer_exit = self._on_exit
        s.tuning_toggler = self.stop_tuning
        self.thread = threading.Thread(target=self._run_safely, name="gptop-tuning", daemon=True)
        self.thread.start()
        return self

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "hello":
            self._proc_running = True
        if kind == "checkpoint":
            self.last_ckpt = (event["step"], event["path"])
        if kind in ("hello", "step", "checkpoint", "error", "done"):
            self.q.put(("event", event))

    def _on_exit(self, code: int) -> bool:
        """Called by the session when the trainer exits: True if the tuning handles it (restart, rollback)."""
        self._proc_running = False
        expected = self._expect_exit
        self.q.put(("exit", code))
        if expected:
            return True
        if self.finished.is_set() or self.session.interrupted:
            return False
        if code == 0:
            return False                      # max steps reached while tuning: the run is done
        return self.ctl is not None and self.ctl._active is not None   # a trial failed: roll back

    def stop_tuning(self) -> None:
        """The `t` key while tuning: stop now, keep the running configuration."""
        self.q.put(("abort", "stopped by the user"))

    # ---------------------------------------------------------- main loop
    def _run_safely(self) -> None:
        try:
            self._run()
        except Exception as e:   # tuning must never take the run down with it
            import traceback

            self.error = f"{type(e).__name__}: {e}"
            self.session._broadcast_log(f"tuning stopped by an internal error: {self.error}")
            self.session._broadcast_log(traceback.format_exc())
            self._restore_log_every()
        finally:
            self.finished.set()

    def _publish(self) -> None:
        path = Path(self.session.run_dir) / "events.jsonl"
        for event in self.ctl.drain_events():
            self.session._emit(event)
            with open(path, "a") as f:          # one small O_APPEND write per line: no tearing with the trainer's
                f.write(ev.dumps(event) + "\n")

    def _next(self, timeout: float = 0.2) -> tuple[str, Any] | None:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def _wait_hello(self) -> dict[str, Any] | None:
        while True:
            item = self._next(1.0)
            if item is None:
                if self.session.finished:
                    return None
                continue
            kind, payload = item
            if kind == "event" and payload["type"] == "hello":
                return payload
            if kind in ("exit", "abort"):
                return None

    def _run(self) -> None:
        from tuner.budget import Budget
        from tuner.controller import Apply, Done, FindMicroBatch, Remeasure, RunTrial, TuneController
        from tuner.space import SearchSpace
        from tuner.study import TuneStudy

        hello = self._wait_hello()
        if hello is None:
            return
        self._hello = hello
        d = dict(hello["device"])
        d["capability"] = tuple(d["capability"]) if d.get("capability") else None
        dev = DeviceInfo(**d)
        cfg = TrainConfig.from_dict(hello["config"])
        base_mb = self.session.cfg.toggles.micro_batch
        start = dataclasses.replace(cfg.toggles, micro_batch=base_mb)
        world = hello.get("world_size", 1)
        space = SearchSpace.for_device(start, dev, cfg.optim.global_batch, world_size=world, spec=self.space_spec)
        cfg.toggles = start
        self.study = TuneStudy.open(cfg, dev, space, storage=self.storage, world_size=world)
        # A trial may use at most ~1/8 of the budget, so even a short budget sees several trials.
        per_trial = max(10.0, min(300.0, self.budget_s / 8))
        self.ctl = ctl = TuneController(cfg, dev, space, self.study, Budget(self.budget_s), max_seconds=per_trial,
                                        default_restart_s=min(60.0, per_trial))
        self.session._broadcast_log(f"tuning for up to {self.budget_s:.0f} s, study {self.study.name}")
        trial_index = 0
        while True:
            action = ctl.next_action()
            self._publish()
            if isinstance(action, FindMicroBatch):
                ctl.set_max_micro_batch(hello.get("micro_batch") if base_mb == "auto" else None)
                continue
            if isinstance(action, (RunTrial, Remeasure)):
                fault = None
                if isinstance(action, RunTrial) and not action.baseline:
                    trial_index += 1
                    if self.test_fault and self.test_fault[0] == trial_index:
                        fault = self.test_fault[1]
                pre = self.last_ckpt
                if action.restart or not self._proc_running:
                    pre = self._restart(action.toggles, fault=fault, strict=True)
                    if pre is None:
                        return
                outcome, reason = self._measure()
                if outcome == "abort":
                    ctl.abort(reason)
                    self._publish()
                    return self._finish(ctl)
                if outcome == "finished":
                    ctl.abort("the run reached --max-steps while tuning")
                    self._publish()
                    return self._finish(ctl)
                if outcome in STEADY:
                    ctl.finish_trial("ok")
                else:
                    self._rollback(pre)
                    ctl.finish_trial(outcome, reason)
                self._publish()
                continue
            if isinstance(action, (Apply, Done)):
                self._restore_log_every()
                if self.tune_only:
                    self._finish(ctl)
                    self.session.stop(interrupted=False)
                    return
                if action.restart or not self._proc_running:
                    if self._restart(action.toggles, strict=False) is None:
                        return
                self._publish()
                self._finish(ctl)
                return

    def _measure(self) -> tuple[str, str]:
        """Feed events to the controller until the trial should stop; returns (stop kind, reason)."""
        ctl = self.ctl
        while True:
            item = self._next()
            if item is not None:
                kind, payload = item
                if kind == "event":
                    ctl.observe(payload)
                elif kind == "exit":
                    stop = ctl.trial_should_stop()
                    if payload == 0 and not self._expect_exit:
                        return "finished", "run finished"
                    if stop and stop not in STEADY:
                        return stop, ""
                    return "crash", f"the trainer exited with code {payload} during the trial"
                elif kind == "abort":
                    return "abort", str(payload)
            stop = ctl.trial_should_stop()
            if stop:
                return stop, ""

    # ------------------------------------------------------------ processes
    def _stop_trainer(self, kill: bool = False) -> None:
        sup = self.session.supervisor
        if sup is None or not sup.alive():
            self._proc_running = False
            return
        self._expect_exit = True
        if kill:
            sup.kill()
        else:
            sup.request_stop()
        while True:                       # wait for its exit (its checkpoint event comes first)
            item = self._next(1.0)
            if item is None:
                continue
            kind, payload = item
            if kind == "event":
                self.ctl.observe(payload) if payload["type"] == "checkpoint" else None
            elif kind == "exit":
                break
        self._expect_exit = False

    def _restart(self, toggles: Toggles, fault: str | None = None, strict: bool = True) -> tuple[int, str] | None:
        """Checkpoint (graceful stop), then start a trainer with `toggles` from that checkpoint."""
        self._stop_trainer()
        if self.session.interrupted:
            return None
        pre = self.last_ckpt
        cfg = self._cfg_with(toggles, strict)
        if fault and pre:
            cfg.run.fault = f"{fault}@{pre[0] + 2}"
        self.session.spawn(cfg, resume=pre[1] if pre else None)
        return pre or (0, "")

    def _cfg_with(self, toggles: Toggles, strict: bool) -> TrainConfig:
        base = self.session.cfg
        cfg = TrainConfig.from_dict(base.to_dict())
        cfg.toggles = dataclasses.replace(toggles)
        cfg.run.fault = None
        if strict:
            cfg.run.nan_policy = "stop"       # a NaN ends the trial; the driver rolls back
        return cfg

    def _rollback(self, pre: tuple[int, str] | None) -> None:
        """Kill the failed trial if it still runs and forget the checkpoints it wrote."""
        self._stop_trainer(kill=True)
        run_dir = Path(self.session.run_dir)
        keep_step = pre[0] if pre else -1
        for info in ckpt.list_checkpoints(run_dir):
            if info.step > keep_step:
                info.path.unlink(missing_ok=True)
        self.last_ckpt = pre if pre and pre[1] else None
        self.session._broadcast_log(f"trial rolled back to step {max(keep_step, 0)}")

    def _restore_log_every(self) -> None:
        self.session.cfg.log.log_every = self.user_log_every

    def _finish(self, ctl) -> None:
        from tuner.report import write_report

        paths = write_report(self.session.run_dir, self.study, ctl.report_info())
        self.session._broadcast_log(f"tuning report: {paths['md']}; best configuration: {paths['toml']}")
        self._restore_log_every()


def attach_tuning(session, budget_s: float, **kw: Any) -> TuningDriver:
    return TuningDriver(session, budget_s, **kw).attach()
