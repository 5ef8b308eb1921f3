"""The controller driven through whole simulated tunings: fake clock, synthetic trainer, no processes."""

import dataclasses
import json
import math
import random
import re

import pytest

from trainer.contract.config import TrainConfig, config_from_toml
from fixtures.toggles import Toggles
from trainer.contract.config import Toggles as ToggleValues
from trainer.contract.device import DeviceInfo
from trainer.contract.events import TrialEvent, dumps, make, parse
from tuner.budget import Budget
from tuner.controller import Apply, Check, Done, FindMicroBatch, Remeasure, RunTrial, TuneController, TunerSettings
from tuner.decide import Choice
from tuner.tuning_report import best_toml, format_summary, write_report
from tuner.space import SearchSpace, params_key
from tuner.study import TuneStudy

CPU = DeviceInfo(type="cpu", name="cpu", has_compiler=True)
SPEC = "-all compile=off,default fused_adamw=on,off prefetch=0,2 micro_batch=4,8,16,32 precision=fp32,bf16"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeTrainer:
    """Step times from the toggles; compile=default warms up slowly; some configurations fail."""

    def __init__(self, clock, seed=0, bf16_diverges=True, base_oom=False, restart_s=5.0):
        self.clock, self.rng, self.bf16_diverges, self.base_oom = clock, random.Random(seed), bf16_diverges, base_oom
        self.restarts = 0
        self.applied = None  # the toggles the run trains on with after an Apply (drive sets it)
        self.restart_s = restart_s  # a process start: import, build, first step

    def step_ms(self, t: Toggles, i: int) -> float:
        ms = 400.0
        ms *= 0.6 if t.compile == "default" else 1.0
        ms *= 0.9 if t.fused_adamw else 1.0
        ms *= 1.15 if t.prefetch == 0 else 1.0
        ms *= {4: 1.2, 8: 1.0, 16: 0.95, 32: 0.95}.get(t.micro_batch, 1.0)
        ms *= 0.8 if t.precision == "bf16" else 1.0
        if t.compile == "default" and i < 3:
            ms += 20000.0 / (i + 1)  # compilation
        return ms * (1 + self.rng.gauss(0, 0.01))

    def failure(self, t: Toggles):
        if t.micro_batch == 16 and not t.activation_checkpointing:
            return ("oom", 2)  # OOM at the second step
        if t.compile == "default" and t.prefetch == 0 and t.fused_adamw:
            return ("compile", 1)
        return None

    def warnings(self, t: Toggles, i: int) -> list[str]:
        """The compile watchdog's warning kinds at the trial's i-th step (none by default)."""
        return []

    @staticmethod
    def loss(step: int, t: Toggles, diverge: bool) -> float:
        v = 2.0 + 6.0 / math.sqrt(step + 1)
        return v + (0.8 if diverge else 0.0)


def drive(ctl: TuneController, clock: Clock, trainer: FakeTrainer, pre_steps: int = 30):
    """What the gptop session does, minus processes. Returns the actions seen."""
    seen = []
    step = 0
    for _ in range(pre_steps):  # training before tuning starts
        step += 1
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=step,
                tokens=4096,
                loss=trainer.loss(step, Toggles(), False),
                lr=1e-3,
                grad_norm=1.0,
                step_ms=400.0,
                phases_ms={},
                tokens_per_s=1.0,
                mfu=0.0,
                mem_bytes=10**9,
            )
        )
    checkpoint_step = step
    for _ in range(200):
        action = ctl.next_action()
        seen.append(action)
        if isinstance(action, FindMicroBatch):
            clock.t += 15.0
            ctl.set_max_micro_batch(8)
            continue
        if isinstance(action, (RunTrial, Remeasure, Check)):  # a check: the applied setting, on the live run
            t = action.toggles
            if action.restart:
                clock.t += trainer.restart_s  # restart from the checkpoint
                trainer.restarts += 1
                ctl.observe(make("checkpoint", step=checkpoint_step, path="ckpt", seconds=2.0))
            fail = trainer.failure(t)
            diverge = trainer.bf16_diverges and t.precision == "bf16"
            stop = None
            step = checkpoint_step
            for i in range(10_000):
                step += 1
                ms = trainer.step_ms(t, i)
                clock.t += ms / 1000.0
                if fail and i + 1 >= fail[1]:
                    ctl.observe(make("error", kind=fail[0], message=f"simulated {fail[0]}"))
                else:
                    ctl.observe(
                        make(
                            "step",
                            step=step,
                            tokens=4096,
                            loss=trainer.loss(step, t, diverge),
                            lr=1e-3,
                            grad_norm=1.0,
                            step_ms=ms,
                            phases_ms={},
                            tokens_per_s=0.0,
                            mfu=0.0,
                            mem_bytes=2 * 10**9 + t.micro_batch * 10**8,
                            time=clock.t,
                        )
                    )
                for kind in trainer.warnings(t, i):  # the compile watchdog's, at this step
                    ctl.observe(make("warning", message=f"simulated {kind}", kind=kind, step=step))
                stop = ctl.trial_should_stop()
                if stop:
                    break
            if stop in ("done", "prune", "budget"):
                checkpoint_step = step  # healthy: steps kept, checkpoint taken
                ctl.finish_trial("ok")
            else:
                ctl.finish_trial(stop)  # rolled back to checkpoint_step
            continue
        if isinstance(action, Apply):
            trainer.applied = action.toggles  # the run trains on with it from now
            continue
        if isinstance(action, Done):
            return seen
    raise AssertionError("the controller never finished")


def make_ctl(tmp_path, clock, budget_s=900.0, spec=SPEC, storage=None, run_steps=20_000, **kw):
    cfg = TrainConfig()
    cfg.data.seq_len = 128
    cfg.optim.global_batch = 32
    cfg.optim.max_steps = run_steps
    cfg.toggles.micro_batch = "auto"
    cfg.toggles.fused_adamw = False  # a start the recipe improves on
    space = SearchSpace.for_device(dataclasses.replace(cfg.toggles, micro_batch=8), CPU, 32, spec=spec)
    study = TuneStudy.open(cfg, CPU, space, storage=storage or f"journal:{tmp_path}/tuning.log", seed=0, wall=clock)
    kw.setdefault("max_trials", 8)
    kw.setdefault("min_steps", 6)
    return TuneController(
        cfg, CPU, space, study, Budget(budget_s, clock=clock), clock=clock, settings=TunerSettings(**kw)
    )


def test_full_simulated_tuning_ends_in_apply(tmp_path):
    clock = Clock()
    trainer = FakeTrainer(clock)
    ctl = make_ctl(tmp_path, clock)
    seen = drive(ctl, clock, trainer)

    assert isinstance(seen[0], FindMicroBatch)
    baseline = seen[1]
    assert isinstance(baseline, RunTrial) and baseline.baseline and not baseline.restart
    assert baseline.toggles.micro_batch == 8  # auto resolved to what fits
    trials = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    assert trials[0].source == "recipe" and trials[0].toggles.compile == "off"  # no compile in the CPU recipe
    assert 1 <= len(trials) <= 8
    assert isinstance(seen[-2], Apply) and isinstance(seen[-1], Done)
    apply = seen[-2]
    assert apply.toggles.compile == "default" and apply.toggles.precision == "fp32"
    assert apply.decision.apply and apply.decision.expected_saving_s > apply.decision.cost_s
    assert seen[-1].toggles == apply.toggles

    events = ctl.drain_events()
    types = [e.type for e in events]
    assert "apply" in types and "tuner" in types and "trial" in types
    running = [e for e in events if e.type == "trial" and e.status == "running"]
    assert running and all(e.number is not None for e in running)  # views key rows by number
    trial_events = [e for e in events if e.type == "trial" and e.status != "running"]
    statuses = {e.status for e in trial_events}
    assert "infeasible" in statuses  # screened OOM, compile error or divergence
    for e in trial_events:
        assert isinstance(e, TrialEvent) and isinstance(e.toggles, ToggleValues) and e.reason is not None
        assert parse(dumps(e)) == e
    # micro-batch 16 and 32 can never fit (max 8, same precision): screened, not run
    assert not any(a.toggles.micro_batch in (16, 32) and a.toggles.precision == "fp32" for a in trials)
    # bf16 changes numerics: its loss runs off the trend and the trial is rolled back as diverged
    bf16 = [
        e
        for e in trial_events
        if e.toggles.precision == "bf16" and e.kind == "trial" and e.toggles.micro_batch in (8, 4)
    ]
    assert bf16 and all(e.status == "infeasible" and "diverged" in e.reason for e in bf16)
    tuner = [e for e in events if e.type == "tuner"]
    assert tuner[-1].phase == "done" and tuner[-1].budget_left_s >= 0
    info = ctl.report_info()
    assert info["ledger"]["tuning_s"] <= 900.0 + 1e-6 + 60
    assert info["applied"] == dataclasses.asdict(apply.toggles)

    paths = write_report(tmp_path / "run", ctl.study, info)
    report = json.loads(paths["json"].read_text())
    assert report["speedup"] > 1.3 and report["trials"]
    summary = format_summary(report)  # what `gptop report` prints
    assert summary.startswith("tuning    best (trial") and "applied" in summary
    assert re.search(r"\d\.\d\dx \(\d\.\d\d-\d\.\d\dx\) the start", summary), summary  # the ratio's interval
    # where the study lives, and the command that browses it (docs/tuning.md)
    assert report["study"] == ctl.study.name and report["storage"] == f"journal:{tmp_path}/tuning.log"
    assert f"study {ctl.study.name} in journal:{tmp_path}/tuning.log" in summary
    assert f"optuna-dashboard {tmp_path}/tuning.log" in summary
    md = paths["md"].read_text()
    assert "| # | run |" in md and "compile=default" in md and "Ledger" in md and "infeasible" in md
    cfg = config_from_toml(paths["toml"])
    cfg.validate()
    assert cfg.toggles == apply.toggles
    assert paths["toml"].read_text().count("[") == 1  # only the [toggles] table


@pytest.mark.slow
def test_trials_carry_energy_per_token_from_the_sessions_energy(tmp_path):
    """The tuner once read energy from step events nobody wrote: every trial's energy was empty. Now the
    session's one energy computation (here: a steady 300 W) measures each trial's kept steps."""
    clock = Clock()
    watts = 300.0
    ctl = make_ctl(tmp_path, clock, energy=lambda t0, t1: watts * (t1 - t0))
    drive(ctl, clock, FakeTrainer(clock))
    measured = [e for e in ctl.drain_events() if e.type == "trial" and e.status in ("ok", "cut")]
    assert measured
    for e in measured:  # J/token = W / (tokens/s), the median throughput within a few %
        assert e.energy_per_token == pytest.approx(watts / e.tokens_per_s, rel=0.05)
    attrs = [t.user_attrs for t in ctl.study.trials() if t.user_attrs.get("status") in ("ok", "cut")]
    assert attrs and all(a["energy_per_token"] > 0 for a in attrs)
    assert ctl.study.study.user_attrs["baseline"]["energy_per_token"] > 0
    md = write_report(tmp_path / "out", ctl.study, ctl.report_info())["md"].read_text()
    assert "| energy/token |" in md and " mJ |" in md and "mJ/token" in md
    assert "mJ/token" in format_summary(json.loads((tmp_path / "out" / "tuning.json").read_text()))

    clock = Clock()  # no reading: no column, no figure, never 0
    ctl = make_ctl(tmp_path / "none", clock, energy=lambda t0, t1: None)
    drive(ctl, clock, FakeTrainer(clock))
    trial_events = [e for e in ctl.drain_events() if e.type == "trial"]
    assert trial_events and all(e.energy_per_token is None for e in trial_events)
    md = write_report(tmp_path / "out2", ctl.study, ctl.report_info())["md"].read_text()
    assert "energy" not in md.replace(str(tmp_path), "")  # (the study's storage path names this test)


def test_budget_stops_starting_trials_it_cannot_afford(tmp_path):
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, budget_s=300.0, max_trials=50, default_restart_s=10.0)
    seen = drive(ctl, clock, FakeTrainer(clock))
    assert isinstance(seen[-1], Done) or isinstance(seen[-2], Apply)
    assert 1 <= ctl.record.trials_run < 50 and ctl.record.stop_note.startswith("budget")
    assert ctl.budget.elapsed() <= 300.0  # nothing was started that could not finish


@pytest.mark.parametrize("max_trials", [1, 3])
def test_max_trials_ends_the_trials_with_budget_left_and_says_so(tmp_path, max_trials):
    """`--max-trials N`: N trials run (re-measurements and the check are not trials), then the tuner decides,
    the budget not spent; the report says why the trials ended."""
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, budget_s=3600.0, max_trials=max_trials)
    seen = drive(ctl, clock, FakeTrainer(clock))
    assert isinstance(seen[-1], Done)
    trials = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    assert len(trials) == ctl.record.trials_run == max_trials
    assert ctl.record.stop_note == f"ran the maximum of {max_trials} trials (--max-trials)"
    assert ctl.budget.left() > 0
    assert ctl.report_info()["stop_note"] == ctl.record.stop_note


@pytest.mark.slow
def test_a_trial_that_overruns_is_cut_by_the_budget(tmp_path):
    clock = Clock()
    # rel_ci so tight nothing is ever stable: the first real trial runs into the end of the budget
    ctl = make_ctl(
        tmp_path,
        clock,
        budget_s=400.0,
        rel_ci=1e-6,
        max_steps=100_000,
        max_seconds=10_000,
        default_restart_s=1.0,
        remeasure_top=0,
    )
    ctl.set_max_micro_batch(8)
    trainer = FakeTrainer(clock)
    a = ctl.next_action()
    assert a.baseline
    for i in range(40):  # a short, healthy baseline
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=i + 1,
                tokens=0,
                loss=3.0,
                lr=0,
                grad_norm=0,
                step_ms=400.0 + i % 3,
                phases_ms={},
                tokens_per_s=0,
                mfu=0,
                mem_bytes=1,
                time=clock.t,
            )
        )
    ctl.finish_trial("ok")
    a = ctl.next_action()
    assert isinstance(a, RunTrial) and not a.baseline
    stop, i = None, 0
    while stop is None:
        i += 1
        clock.t += trainer.step_ms(a.toggles, i) / 1000.0
        ctl.observe(
            make(
                "step",
                step=100 + i,
                tokens=0,
                loss=3.0,
                lr=0,
                grad_norm=0,
                step_ms=trainer.step_ms(a.toggles, i),
                phases_ms={},
                tokens_per_s=0,
                mfu=0,
                mem_bytes=1,
                time=clock.t,
            )
        )
        stop = ctl.trial_should_stop()
    assert stop == "budget"
    ev = ctl.finish_trial("ok")
    assert ev.status == "cut" and ev.tokens_per_s > 0
    # the reason in words, with the noise left (never an internal name like "budget: not stable")
    assert ev.reason.startswith("the tuning budget ran out after ") and "% noisy (stable is ±" in ev.reason
    assert "not stable" not in ev.reason and "max_seconds" not in ev.reason
    assert ctl.study.trials()[a.number].state.name == "COMPLETE"  # a usable, if wider, measurement
    assert isinstance(ctl.next_action(), (Apply, Done))


class CloseRace(FakeTrainer):
    """Two configurations within noise of each other: the decision must re-measure both."""

    def step_ms(self, t, i):
        ms = 400.0 if t.compile == "off" else (300.0 if t.fused_adamw else 303.0)
        ms *= 1.15 if t.prefetch == 0 else 1.0
        return ms * (1 + self.rng.gauss(0, 0.02)) + (3000.0 if t.compile == "default" and i < 2 else 0.0)

    def failure(self, t):
        return None


def test_close_candidates_are_remeasured_best_last(tmp_path):
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, spec="-all compile=off,default fused_adamw=on,off", rel_ci=0.05, max_trials=3)
    seen = drive(ctl, clock, CloseRace(clock, bf16_diverges=False))
    rem = [a for a in seen if isinstance(a, Remeasure)]
    assert len(rem) == 2
    assert {a.toggles.compile for a in rem} == {"default"}
    first, last = rem
    assert first.number != last.number
    pooled = {c.number: c for c in ctl.study.candidates()}
    assert pooled[last.number].remeasured == 1 and pooled[first.number].remeasured == 1
    assert pooled[first.number].n > len(ctl.study.trials()[first.number].user_attrs["samples"])  # pooled
    apply = seen[-2]
    assert isinstance(apply, Apply) and apply.toggles.compile == "default"
    assert apply.restart is (apply.toggles != last.toggles)  # the presumed best ran last
    # never "0 s": the trial's own process trains on only after a restart with the user's settings (nan policy),
    # which costs what this setup's restarts into that configuration cost
    measured = [
        r["overhead_s"] for r in ctl.record.results if r["overhead_s"] is not None and r["toggles"] == apply.toggles
    ]
    assert measured and apply.decision.cost_s == pytest.approx(sorted(measured)[len(measured) // 2], rel=0.5)
    assert apply.decision.cost_s > 0 and "0s switch" not in apply.decision.reason


@pytest.mark.slow
def test_second_run_starts_from_what_was_learned(tmp_path):
    clock = Clock()
    first = make_ctl(tmp_path, clock)
    drive(first, clock, FakeTrainer(clock))
    best1, tps1 = first.study.best_known()
    n_first = len(first.study.trials())

    clock2 = Clock()
    second = make_ctl(tmp_path, clock2, max_trials=3)
    assert second.study.best_known()[0] == best1  # the session could skip tuning entirely
    seen = drive(second, clock2, FakeTrainer(clock2, seed=1))
    assert not isinstance(seen[0], FindMicroBatch)  # max micro-batch remembered in the study
    trials = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    assert trials and all(a.source != "recipe" for a in trials)  # warm start not repeated
    first_keys = {
        params_key(t.params)
        for t in first.study.trials()[:n_first]
        if t.user_attrs.get("status") in ("ok", "cut", "pruned", "infeasible")
    }
    assert trials and all(params_key(second.space.to_params(a.toggles)) not in first_keys for a in trials)
    assert isinstance(seen[-1], Done)
    report = json.loads(write_report(tmp_path / "run2", second.study, second.report_info())["json"].read_text())
    runs = {r["run"] for r in report["trials"]}
    assert runs == {"this", "earlier"}  # the table marks what earlier runs learned


def test_failing_baseline_and_abort(tmp_path):
    clock = Clock()
    ctl = make_ctl(tmp_path, clock)
    ctl.set_max_micro_batch(8)
    a = ctl.next_action()
    assert isinstance(a, RunTrial) and a.baseline
    ctl.observe(make("error", kind="oom", message="boom"))
    assert ctl.trial_should_stop() == "oom"
    ev = ctl.finish_trial("oom")
    assert ev.status == "infeasible" and ctl.record.baseline is None
    b = ctl.next_action()
    assert isinstance(b, RunTrial) and not b.baseline and b.restart
    assert ctl.next_action() is b  # same action until finished
    ctl.abort("user quit")
    done = ctl.next_action()
    assert isinstance(done, Done) and done.reason == "user quit"
    t = ctl.study.trials()[b.number]
    assert t.state.name == "FAIL" and t.user_attrs["status"] == "abandoned"
    with pytest.raises(RuntimeError):
        ctl.finish_trial("ok")


def test_best_toml_alone_round_trips(tmp_path):
    t = Toggles(precision="bf16", compile="default", micro_batch=16, prefetch=4, workers=1, fused_adamw=True)
    p = tmp_path / "best.toml"
    p.write_text(best_toml(t))
    assert config_from_toml(p).toggles == t


def test_best_toml_of_a_script_says_how_to_apply_it_to_that_script(tmp_path):
    """`gptop tune -- CMD`'s best.toml: not gptop train flags, but the TrainingArguments to set in the script (from
    its start and per-device batch), or the same toggles through its tuned_args under gptop run; the [toggles]
    table still round-trips, and the GPTOP_TOGGLES it gives reads back as those toggles."""
    import shlex

    from trainer.contract.client import TOGGLES_ENV, parse_toggles
    from tuner.tuning_report import TunedCommand

    start = Toggles(precision="fp32", compile="off", micro_batch=1, prefetch=2, workers=0, fused_adamw=False)
    best = dataclasses.replace(start, precision="bf16", micro_batch=4, fused_adamw=True)
    command = TunedCommand(argv=["python", "hf.py", "--steps", "2600"], start=start, per_device=16)
    text = best_toml(best, command)
    p = tmp_path / "best.toml"
    p.write_text(text)
    assert config_from_toml(p).toggles == best
    comment = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert comment[0] == "Best settings gptop tune found for: python hf.py --steps 2600"
    assert "gptop train" not in text.replace("not gptop train flags", "")
    assert "bf16=True, per_device_train_batch_size=4, gradient_accumulation_steps=4, optim='adamw_torch_fused'" in text
    env = next(line for line in comment if TOGGLES_ENV in line).strip()
    assert env.endswith("gptop run -- python hf.py --steps 2600")
    assert parse_toggles(shlex.split(env)[0].partition("=")[2]) == best
    unknown = best_toml(best, dataclasses.replace(command, per_device=None))  # the hello said no batch
    assert "TrainingArguments" not in unknown and TOGGLES_ENV in unknown
    assert "nothing to change" in best_toml(start, command)


def test_start_outside_the_space_is_still_the_baseline(tmp_path):
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, spec="-all precision=bf16 compile=off,default", max_trials=4)
    seen = drive(ctl, clock, FakeTrainer(clock, bf16_diverges=False))
    base = seen[1]
    assert isinstance(base, RunTrial) and base.baseline and base.number is None  # measured, not a trial
    assert ctl.record.baseline is not None and ctl.record.baseline_number is None
    runs = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    assert runs and all(a.toggles.precision == "bf16" and a.numerics_changing for a in runs)
    assert isinstance(seen[-2], Apply) and seen[-2].toggles.precision == "bf16"
    md = write_report(tmp_path / "run", ctl.study, ctl.report_info())["md"].read_text()
    assert "precision=bf16" in md


def test_cuda_graph_modes_with_accumulation_are_never_run(tmp_path):
    """reduce-overhead in the space of a GPU run whose micro-batches accumulate: every proposal pairing it
    with accumulation is screened as infeasible with the reason (the trainer would refuse it), never run."""
    h100 = DeviceInfo(type="cuda", index=0, name="NVIDIA H100", capability=(9, 0), total_memory=80 * 2**30)
    clock = Clock()
    cfg = TrainConfig()
    cfg.data.seq_len, cfg.optim.global_batch, cfg.optim.max_steps = 128, 32, 20_000
    cfg.toggles.micro_batch = 8
    spec = "-all compile=off,reduce-overhead micro_batch=4,8,32 fused_adamw=on,off"
    space = SearchSpace.for_device(cfg.toggles, h100, 32, spec=spec)
    study = TuneStudy.open(cfg, h100, space, storage=f"journal:{tmp_path}/tuning.log", seed=0, wall=clock)
    ctl = TuneController(
        cfg,
        h100,
        space,
        study,
        Budget(900.0, clock=clock),
        clock=clock,
        settings=TunerSettings(max_trials=8, min_steps=6),
    )
    seen = drive(ctl, clock, FakeTrainer(clock))
    ran = [a for a in seen if isinstance(a, (RunTrial, Remeasure))]
    assert ran and not any(a.toggles.compile == "reduce-overhead" and a.toggles.micro_batch < 32 for a in ran)
    screened = [
        e
        for e in ctl.drain_events()
        if e.type == "trial" and e.toggles.compile == "reduce-overhead" and e.toggles.micro_batch < 32
    ]
    assert screened and all(e.status == "infeasible" and "CUDA graphs" in e.reason for e in screened)


# --- paying for itself within the run (a fake clock; every figure is one the ledger then shows) ------------------

NEUTRAL = "-all compile=off,default fused_adamw=on,off prefetch=0,2"


def short_run(tmp_path, clock, max_steps, spec=NEUTRAL, **kw):
    """A run of `max_steps` whose trainer starts in 5 s (as the session measured it); the micro-batch is known."""
    kw.setdefault("startup_s", 5.0)
    ctl = make_ctl(tmp_path, clock, spec=spec, run_steps=max_steps, **kw)
    ctl.set_max_micro_batch(8)
    return ctl


def test_no_trial_runs_when_none_can_pay(tmp_path):
    """200 steps at ~0.46 s: ~70 s left after the baseline. A trial costs a 5 s restart in, a 5 s switch back
    (the start's own process could have trained on) and what its measurement may lose (a quarter of the
    baseline's measuring time, nothing measured yet), more than the 10% of the rest tuning may lose: one line,
    no trial, the start's process trains on."""
    clock = Clock()
    ctl = short_run(tmp_path, clock, 200)
    seen = drive(ctl, clock, FakeTrainer(clock))
    assert [a for a in seen if isinstance(a, RunTrial) and not a.baseline] == []
    done = seen[-1]
    assert isinstance(done, Done) and not done.restart and done.toggles == ctl.base
    cost = 10.0 + 0.25 * ctl.record.baseline["duration_s"]
    assert (
        done.reason.startswith("tuning cannot pay: the run ends in 1:")
        and f"a trial costs ~{cost:.0f} s here" in done.reason
    )
    plan = ctl.ledger.decisions[-1]
    left = plan.remaining_steps * 4096 / ctl.record.baseline["tokens_per_s"]
    assert plan.choice is Choice.PLAN and not plan.apply and plan.cost_s == pytest.approx(cost)
    assert plan.remaining_steps == 200 - ctl.last_step and ctl.ledger.loss_allowance_s == pytest.approx(0.1 * left)
    assert f"more than the {0.1 * left:.0f} s tuning may still lose" in plan.reason
    led = ctl.report_info()["ledger"]
    assert led["decisions"][-1]["choice"] == "plan" and led["decisions"][-1]["cost_s"] == pytest.approx(cost)
    assert led["switch_s"] == 0.0 and led["saving_s"] == 0.0 and led["net_s"] == pytest.approx(-led["cost_s"])
    assert led["cost_s"] < 1.0  # the baseline's steps were the run's own, at its own speed
    assert led["budget_s"] < 900.0 and led["budget_s"] == pytest.approx(0.5 * left, rel=0.05)
    md = write_report(tmp_path / "run", ctl.study, ctl.report_info())["md"].read_text()
    assert "tuning cannot pay" in md and "Net against not tuning: -" in md and "15m00s budget asked for" in md


def test_the_t_key_on_a_run_near_its_end_plans_before_measuring(tmp_path):
    """`t` at step 43 of 200 at 0.45 s per step (the pace the session saw): the decision comes before the
    baseline, from the figures alone: a trial costs its 5 s restart, the 5 s switch back and a quarter of the
    18 steps (8.1 s) a measurement takes at least."""
    clock = Clock()
    ctl = short_run(tmp_path, clock, 200)
    ctl.set_pace(43, 0.45)
    first = ctl.next_action()
    assert isinstance(first, Done) and not first.restart
    assert first.reason.startswith(
        "tuning cannot pay: the run ends in 1:11 (157 steps at 0.45 s); a trial "
        "costs ~12 s here, more than the 7 s tuning may still lose"
    )
    assert ctl.ledger.decisions[-1].cost_s == pytest.approx(10.0 + 0.25 * 18 * 0.45)
    assert ctl.record.trials_run == 0 and ctl.record.baseline is None
    assert [e.phase for e in ctl.drain_events() if e.type == "tuner"][-1] == "done"


def test_the_plan_counts_the_runs_time_between_steps(tmp_path):
    """The same run as above, but its step events come 0.9 s apart for 0.45 s steps (checkpoint saves, evals:
    a script saving every few steps): the run has twice the time left that its steps say, so 10% of it
    covers a trial, and the plan says where the time goes. A faster setting shortens only the steps, so
    the most a trial could save stays what the steps' time allows. A restart's gap is not the run's pace."""
    clock = Clock()
    ctl = short_run(tmp_path, clock, 200)
    t = 5000.0
    for i in range(1, 44):
        t += 0.9 if i != 20 else 30.0  # step 20 came after a 30 s restart: not the run's pace
        if i == 20:
            ctl.observe(make("hello", config=TrainConfig().to_dict(), device=CPU, model={}, start_step=19))
        ctl.observe(
            make(
                "step",
                step=i,
                tokens=4096,
                loss=3.0,
                lr=1e-3,
                grad_norm=1.0,
                step_ms=450.0,
                phases_ms={},
                tokens_per_s=1.0,
                mfu=0.0,
                mem_bytes=10**9,
                time=t,
            )
        )
    assert ctl.run_pace.between_s() == pytest.approx(0.45)
    ctl.set_pace(43, 0.45)
    first = ctl.next_action()
    assert isinstance(first, RunTrial) and first.baseline  # it measures the start: tuning can pay
    plan = ctl.ledger.decisions[-1]
    assert plan.choice is Choice.PLAN and plan.apply
    assert plan.reason.startswith(
        "tuning can pay: the run ends in 2:21 (157 steps at 0.90 s, 0.45 s of it between steps)"
    )
    assert ctl.ledger.loss_allowance_s == pytest.approx(0.1 * 157 * 0.9)
    assert ctl.report_info()["ledger"]["between_s"] == pytest.approx(0.45)


@pytest.mark.slow
def test_expensive_trials_are_dropped_first(tmp_path):
    """~300 s left: a plain restart (10 s with the switch back) can pay, a compile nobody has measured on this
    setup (45 s more) cannot fit in the 10% tuning may lose. Compile proposals are skipped (not told to the
    sampler as results: a longer run of the same setup still tries them), cheap ones run."""
    clock = Clock()
    ctl = short_run(tmp_path, clock, 700)
    seen = drive(ctl, clock, FakeTrainer(clock, bf16_diverges=False))
    ran = [a for a in seen if isinstance(a, (RunTrial, Remeasure)) and not getattr(a, "baseline", False)]
    assert ran and all(a.toggles.compile == "off" for a in ran)
    dropped = [d for d in ctl.ledger.decisions if d.choice is Choice.TRIAL and d.reason.startswith("compile=default")]
    assert len(dropped) == 1 and not dropped[0].apply and dropped[0].cost_s >= 45.0
    assert "compile=default trials cannot pay any more" in dropped[0].reason
    skipped = [t for t in ctl.study.trials() if t.user_attrs.get("status") == "skipped"]
    assert skipped and all(t.state.name == "FAIL" and t.user_attrs["toggles"]["compile"] == "default" for t in skipped)
    info = ctl.report_info()
    assert info["ledger"]["skipped"] == len(skipped)
    report = json.loads(write_report(tmp_path / "run", ctl.study, info)["json"].read_text())
    assert not any(r["status"] == "skipped" for r in report["trials"])  # counted, not listed
    assert any(d["reason"].startswith("compile=default trials cannot pay") for d in report["ledger"]["decisions"])


class BigWin(FakeTrainer):
    """Slow steps (2 s), and fused AdamW makes them 8x faster: the recipe (fused on) wins big at once."""

    def step_ms(self, t, i):
        return (250.0 if t.fused_adamw else 2000.0) * (1.15 if t.prefetch == 0 else 1.0) * (1 + self.rng.gauss(0, 0.01))

    def failure(self, t):
        return None


def test_it_applies_the_best_once_exploring_is_worth_less(tmp_path):
    """An 8x setting found by the first trial of a 200-step run of 2 s steps whose restarts take 8 s: each further
    trial could add at most the step from the best to the bound over the steps after it; once that is less than
    its restart plus the saving it forgoes while it runs, the best is applied at once, with most of the run left
    to gain on, and the ledger's net counts what tuning cost."""
    clock = Clock()
    ctl = short_run(
        tmp_path,
        clock,
        200,
        spec="-all fused_adamw=on,off prefetch=0,1,2,4 workers=0,1,2",
        startup_s=8.0,
        max_trials=16,
    )
    seen = drive(ctl, clock, BigWin(clock, restart_s=8.0))
    apply = seen[-2]
    assert isinstance(apply, Apply) and apply.toggles.fused_adamw and isinstance(seen[-1], Done)
    stop = [d for d in ctl.ledger.decisions if d.choice is Choice.EXPLORE]
    assert len(stop) == 1 and not stop[0].apply and stop[0].expected_saving_s < stop[0].cost_s
    assert stop[0].reason.startswith(
        f"stopped exploring at step {stop[0].step}: {stop[0].remaining_steps} steps "
        f"left, applying trial {apply.number} saves "
    )
    assert stop[0].remaining_steps > 100 and 1 <= ctl.record.trials_run < 6  # applied with most of the run left
    assert ctl.budget.elapsed() < ctl.budget.total_s - 30  # not because the budget ran out
    switch = ctl.ledger.decisions[-1]
    assert switch.choice is Choice.SWITCH and switch.apply and switch.cost_s > 0
    led = ctl.report_info()["ledger"]
    assert led["net_s"] == pytest.approx(led["saving_s"] - led["cost_s"] - led["switch_s"])
    assert led["saving_s"] == pytest.approx(switch.expected_saving_s) and led["net_s"] > 0
    assert [d["choice"] for d in led["decisions"]][-2:] == ["explore", "switch"]
    md = write_report(tmp_path / "run", ctl.study, ctl.report_info())["md"].read_text()
    assert "stopped exploring at step" in md and "Net against not tuning: +" in md
    summary = format_summary(json.loads((tmp_path / "run" / "tuning.json").read_text()))
    assert "net +" in summary and "against not tuning" in summary


class Machine(FakeTrainer):
    """Another machine (or the same one, loaded): every step `factor` times as long; with `noisy_start`, every
    other step of the start takes 4x as long (another job on the cores), so its interval never narrows."""

    def __init__(self, clock, factor=1.0, noisy_start=False, **kw):
        super().__init__(clock, bf16_diverges=False, **kw)
        self.factor, self.noisy_start = factor, noisy_start

    def step_ms(self, t, i):
        ms = super().step_ms(t, i) * self.factor
        if self.noisy_start and not t.fused_adamw and t.compile == "off" and t.prefetch == 2:
            ms *= 4.0 if i % 2 else 1.0
        return ms

    def failure(self, t):
        return None


def test_a_stored_trial_is_compared_only_within_its_own_run(tmp_path):
    """Run 1 finds its best; run 2 is the same setup on a machine twice as slow. Dividing run 1's measurement by
    run 2's baseline would claim twice the real speed-up: run 2 either re-measures the stored trial or compares it
    with run 1's own baseline, and says it comes from an earlier run."""
    clock = Clock()
    first = make_ctl(tmp_path, clock, spec=NEUTRAL, startup_s=5.0)
    drive(first, clock, Machine(clock))
    best1 = first.best()
    assert best1 is not None and not best1.earlier and best1.speedup > 1.2

    clock2 = Clock()
    second = make_ctl(tmp_path, clock2, spec=NEUTRAL, startup_s=5.0, max_trials=1)
    seen = drive(second, clock2, Machine(clock2, factor=2.0, seed=1))
    apply = next(a for a in seen if isinstance(a, Apply))
    events = second.drain_events()
    ev = next(e for e in events if e.type == "apply")
    assert ev.tokens_per_s / ev.baseline_tokens_per_s == pytest.approx(best1.speedup, rel=0.1)  # not ~2x that
    if apply.number == best1.cand.number:
        assert "from an earlier run" in apply.label
        remeasured = [e for e in events if e.type == "trial" and e.number == apply.number and e.kind == "remeasure"]
        assert remeasured and all(e.earlier for e in remeasured) and ev.earlier
        assert ("re-measured on this one" in apply.label) == bool(remeasured)
    tuner = [e for e in events if e.type == "tuner" and e.best is not None][-1]
    assert tuner.best.number == apply.number
    report = json.loads(write_report(tmp_path / "run2", second.study, second.report_info())["json"].read_text())
    assert report["best_number"] == apply.number and report["speedup"] == pytest.approx(best1.speedup, rel=0.1)


def test_an_unstable_baseline_is_never_a_denominator(tmp_path):
    """The start's steps swing 4x on a loaded machine: its interval stays wider than ±25%, even re-measured, and
    however fast a trial looks against it, no speed-up is claimed; the report says why."""
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, spec=NEUTRAL, startup_s=5.0, max_trials=3)
    seen = drive(ctl, clock, Machine(clock, noisy_start=True))
    base = ctl.record.baseline
    assert base["spread"] > 0.25 * base["tokens_per_s"]
    assert any(isinstance(a, Remeasure) and a.toggles == ctl.base for a in seen)  # it tried to make it hold
    assert not any(isinstance(a, Apply) for a in seen)
    assert "never measured to its precision target" in seen[-1].reason
    assert "no speed-up can be claimed" in seen[-1].reason
    tuner_events = [e for e in ctl.drain_events() if e.type == "tuner"]
    assert tuner_events and all(e.best is None for e in tuner_events)
    md = write_report(tmp_path / "run", ctl.study, ctl.report_info())["md"].read_text()
    assert "never measured to its precision target: no speed-up is claimed against it" in md


class NoisyWinner(FakeTrainer):
    """Prefetch 0 with fused AdamW: half its steps take 80 ms, half 600 ms (a shared machine): its median may look
    fastest, but its interval stays wide however long it is measured."""

    def step_ms(self, t, i):
        if t.prefetch == 0 and t.fused_adamw:
            return 80.0 if self.rng.random() < 0.5 else 600.0
        return 400.0 * (0.9 if t.fused_adamw else 1.0) * (1 + self.rng.gauss(0, 0.01))

    def failure(self, t):
        return None


def test_the_panels_best_is_the_reports_best_and_never_a_wide_measurement(tmp_path):
    from gptop.state import RunState

    clock = Clock()
    ctl = make_ctl(tmp_path, clock, spec=NEUTRAL, startup_s=5.0, run_steps=100_000, max_seconds=30.0, max_trials=8)
    drive(ctl, clock, NoisyWinner(clock, seed=3))
    events = ctl.drain_events()
    noisy = [
        e
        for e in events
        if e.type == "trial" and e.toggles.prefetch == 0 and e.toggles.fused_adamw and e.status in ("ok", "cut")
    ]
    assert noisy and noisy[-1].spread > 0.25 * noisy[-1].tokens_per_s  # it ran, and measured wide
    state = RunState()
    for e in events:
        state.apply(e)
    report = json.loads(write_report(tmp_path / "run", ctl.study, ctl.report_info())["json"].read_text())
    assert report["best_number"] is not None and report["best_number"] != noisy[-1].number
    assert state.tuner.best.number == report["best_number"]


# --- the advice and the compile watchdog (issue 20) ----------------------------------------------------------


def test_the_advices_toggles_are_the_first_proposals_and_say_so(tmp_path):
    """The advice names fused AdamW (optimizer-bound) and a deeper prefetch (data-bound; 8 is not in the space,
    its nearest, 2, is where the start is already: nothing to try), and a compile mode the space does not hold:
    the first trial is fused AdamW alone on the start, from the advice, with its evidence on the row."""
    clock = Clock()
    advice = [
        ("fused_adamw", True, "optimizer is 31% of the step"),
        ("prefetch", 8, "data loading is 18% of the step"),
        ("compile", "reduce-overhead", "GPU idle 40% of the step"),
        ("precision", "bf16", "compute-bound"),
    ]
    ctl = make_ctl(tmp_path, clock, advice=lambda: advice)
    seen = drive(ctl, clock, FakeTrainer(clock, bf16_diverges=False))
    trials = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    first, second = trials[0], trials[1]
    assert first.source == "advice" and first.advice == "optimizer is 31% of the step: fused_adamw=on"
    assert dataclasses.replace(first.toggles, fused_adamw=False) == ctl.base
    assert second.source == "advice" and second.toggles == dataclasses.replace(ctl.base, precision="bf16")
    assert not any(a.source == "advice" for a in trials[2:])  # each once; the recipe and TPE after
    events = [e for e in ctl.drain_events() if e.type == "trial" and e.number == first.number]
    assert events and all(e.source == "advice" and e.advice == first.advice for e in events)
    md = write_report(tmp_path / "run", ctl.study, ctl.report_info())["md"].read_text()
    row = next(x for x in md.splitlines() if x.startswith(f"| {first.number} |"))
    assert "| advice |" in row and "advice: optimizer is 31% of the step: fused_adamw=on" in row


def test_an_advised_trial_still_has_to_pay(tmp_path):
    """The advice says compile=default, but ~300 s are left: a compile nobody has measured cannot pay. The
    advised proposal goes through the same gate as any other: skipped (not run, not a result), cheap trials run."""
    clock = Clock()
    ctl = short_run(
        tmp_path, clock, 700, advice=lambda: [("compile", "default", "compute-bound (forward+backward 80%)")]
    )
    seen = drive(ctl, clock, FakeTrainer(clock, bf16_diverges=False))
    ran = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    assert ran and not any(a.toggles.compile == "default" for a in ran)
    skipped = [
        t
        for t in ctl.study.trials()
        if t.user_attrs.get("status") == "skipped" and t.user_attrs.get("source") == "advice"
    ]
    assert len(skipped) == 1 and skipped[0].user_attrs["toggles"]["compile"] == "default"


class Recompiling(FakeTrainer):
    """compile=default is the fastest by far, but its frame recompiles every 3rd step (a Python value that
    changes), and prefetch=0 recompiles once (a one-off: a shape made dynamic); nothing fails."""

    def failure(self, t):
        return None

    def warnings(self, t, i):
        if t.compile == "default" and t.prefetch != 0 and i >= 3 and i % 3 == 0:
            return ["recompile"]
        if t.compile == "default" and t.prefetch == 0 and i == 4:
            return ["recompile"]
        return []


def test_a_setting_that_kept_recompiling_is_never_applied(tmp_path):
    """Rule (docs/tuning.md): a measurement whose compile recompiled at 2+ distinct steps, or fell back to eager,
    is marked in its row and is not a candidate, however fast it measured; one recompilation is warm-up. Here
    compile=default with prefetch=2 measures fastest but kept recompiling: not applied; with prefetch=0 it
    recompiled once and may win."""
    clock = Clock()
    spec = "-all compile=off,default prefetch=0,2"
    ctl = make_ctl(tmp_path, clock, spec=spec, max_trials=6)
    seen = drive(ctl, clock, Recompiling(clock, bf16_diverges=False))
    events = [e for e in ctl.drain_events() if e.type == "trial" and e.status != "running"]
    unsteady = [e for e in events if e.unsteady]
    assert unsteady and all(e.toggles.compile == "default" and e.toggles.prefetch == 2 for e in unsteady)
    for e in unsteady:
        assert e.compile["recompile"] >= 2 and "kept recompiling" in e.reason
    once = [e for e in events if e.toggles.compile == "default" and e.toggles.prefetch == 0 and e.kind == "trial"]
    assert once and all(not e.unsteady and e.compile == {"recompile": 1} for e in once)
    assert "recompiled once" in once[0].reason
    applied = [a for a in seen if isinstance(a, Apply)]
    assert not any(a.toggles.compile == "default" and a.toggles.prefetch == 2 for a in applied)
    best = ctl.best()
    assert best is None or not (best.cand.toggles.compile == "default" and best.cand.toggles.prefetch == 2)
    refused = [d for d in ctl.ledger.decisions if d.choice is Choice.CANDIDATE]
    assert refused and all(not d.apply and "kept recompiling" in d.reason for d in refused)
    paths = write_report(tmp_path / "run", ctl.study, ctl.report_info())
    report = json.loads(paths["json"].read_text())
    rows = [r for r in report["trials"] if r["unsteady"]]
    assert rows and all(r["compile"]["recompile"] >= 2 for r in rows)
    assert "kept recompiling" in paths["md"].read_text()
    # the sampler and later runs do not build on it: a violated constraint
    assert all(c.toggles.prefetch != 2 or c.toggles.compile != "default" for c in ctl.study.candidates())


class SlowSteps(FakeTrainer):
    """Steps of ~2 s (a CPU training a real model at micro-batch 1): in a short budget a trial's time cap from
    the budget alone (10 s) holds five steps, never the samples a measurement needs to settle."""

    def step_ms(self, t: Toggles, i: int) -> float:
        return 5.0 * super().step_ms(t, i)


def test_slow_steps_get_measurements_long_enough_to_settle(tmp_path):
    """A measurement's time cap is never under what the fewest samples of a stable measurement take at the run's
    pace, and the trial timeout never cuts one before its own cap (the start's measurement, on the run's own
    process, may take four times a trial's): with ~2 s steps and a 10 s cap from the budget, every measurement
    ended cut, so no speed-up could be claimed however large."""
    clock = Clock()
    ctl = make_ctl(tmp_path, clock, budget_s=900.0, spec=NEUTRAL, max_seconds=10.0, trial_timeout_s=30.0, max_trials=3)
    seen = drive(ctl, clock, SlowSteps(clock), pre_steps=0)
    measured = [a for a in seen if isinstance(a, (RunTrial, Remeasure, Check))]
    m = measured[0].measure
    fewest = m.skip + 2 * m.window + m.min_steps
    for a in measured[1:]:  # the start's pace known: ~2 s a step
        assert a.measure.max_seconds >= fewest * 1.9, (a, a.measure.max_seconds)
    rows = [e for e in ctl.drain_events() if e.type == "trial" and e.status != "running"]
    steady = [e for e in rows if e.toggles.compile == "off" and e.status != "infeasible"]  # a compile may time out
    assert len(steady) >= 2 and all(e.status == "ok" for e in steady), [(e.number, e.reason) for e in steady]
    assert ctl.record.baseline["spread"] <= 0.03 * ctl.record.baseline["tokens_per_s"]  # the start holds
    assert any(isinstance(a, Apply) for a in seen), seen[-1]  # a faster setting is claimed and applied
