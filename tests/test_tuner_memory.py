"""Memory as a constraint the tuner trades: when the wanted micro-batch does not fit, the space widens to
activation checkpointing, the optimizer and (LoRA on a model directory, where the device supports it) a
quantized base; those numerics-changing trials get the loss check; every trial's peak memory is reported,
an OOM's too. Pure: fake devices, fake events, a fake clock; no torch, no processes."""

import dataclasses

import pytest

from test_tuner_controller import Clock
from trainer.contract import capabilities
from trainer.contract.config import ConfigError, TrainConfig
from fixtures.toggles import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import make
from tuner.budget import Budget
from tuner.controller import Apply, Done, FindMicroBatch, Remeasure, RunTrial, TuneController, TunerSettings
from tuner.tuning_report import best_toml, build_report, check_best_toml, format_summary, render_markdown
from tuner.space import MEMORY_SAVING, SearchSpace, memory_pressure, quantizable
from tuner.study import TuneStudy

CPU = DeviceInfo(type="cpu", name="cpu", has_compiler=True)
H100 = DeviceInfo(
    type="cuda", name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, capability=(9, 0), has_compiler=True
)
FULL_BATCH = "the whole per-rank batch (32) does not fit: 8 is the largest micro-batch that fits"


@pytest.fixture
def torchao_and_bnb(monkeypatch):
    """The optional libraries as installed (the gate asks importlib, without importing them)."""
    monkeypatch.setattr(capabilities, "_installed", lambda module: True)


# --- when memory is the constraint ----------------------------------------------------------------


def test_memory_pressure_is_the_wanted_micro_batch_above_what_fits():
    cfg = TrainConfig()
    cfg.optim.global_batch = 32
    assert memory_pressure(cfg, 8).startswith(FULL_BATCH)
    assert "4 accumulation steps" in memory_pressure(cfg, 8)
    assert memory_pressure(cfg, 32) is None  # the whole batch fits
    assert memory_pressure(cfg, None) is None  # not probed
    cfg.toggles.micro_batch = 16  # asked for, and it ran: nothing to trade
    assert memory_pressure(cfg, None) is None
    assert memory_pressure(cfg, 4).startswith("--micro-batch 16 does not fit")
    assert memory_pressure(cfg, 16, world_size=2) is None  # 16 per rank is the whole per-rank batch


def test_quantizable_only_for_lora_on_a_model_directory():
    cfg = TrainConfig()
    assert not quantizable(cfg)
    cfg.finetune.lora = 8
    assert not quantizable(cfg)  # a family starts from random weights
    cfg.model.model = "/models/llama-3-8b"
    assert quantizable(cfg)


# --- the space ------------------------------------------------------------------------------------


def test_default_space_keeps_the_runs_optimizer_and_base(torchao_and_bnb):
    s = SearchSpace.for_device(Toggles(), CPU, 32)
    assert s.choices["optimizer"] == ("adamw",) and s.choices["quantize_base"] == ("none",)
    assert s.memory is None and "optimizer" not in s.params
    # widened by hand: the slow low-bit optimizers only when named
    s = SearchSpace.for_device(Toggles(), CPU, 32, spec="optimizer+=adamw-8bit")
    assert s.choices["optimizer"] == ("adamw", "adamw-8bit")
    assert s.numerics_changing(s.to_toggles({"optimizer": "adamw-8bit"}))


def test_memory_widens_to_checkpointing_and_smaller_optimizers_never_a_quantized_base_on_the_cpu(torchao_and_bnb):
    start = Toggles(activation_checkpointing=False)
    s = SearchSpace.for_device(start, CPU, 32, memory=FULL_BATCH, quantizable=True, spec="-activation_checkpointing")
    # the spec applies after the widening: the user's word is last
    assert s.choices["activation_checkpointing"] == (False,)
    s = SearchSpace.for_device(start, CPU, 32, memory=FULL_BATCH, quantizable=True)
    assert s.choices["activation_checkpointing"] == (False, True)
    assert s.choices["optimizer"] == ("adamw", "adamw-8bit", "adamw-4bit", "adafactor")
    assert s.choices["quantize_base"] == ("none",)  # gated: bitsandbytes needs CUDA
    assert s.memory == FULL_BATCH
    # only values with a smaller state than the start's
    s = SearchSpace.for_device(Toggles(optimizer="adamw-8bit"), CPU, 32, memory=FULL_BATCH)
    assert s.choices["optimizer"] == ("adamw-8bit", "adamw-4bit", "adafactor")


def test_memory_widens_to_a_quantized_base_where_the_device_has_it(torchao_and_bnb):
    s = SearchSpace.for_device(Toggles(), H100, 32, memory=FULL_BATCH, quantizable=True)
    assert s.choices["quantize_base"] == ("none", "nf4", "int8")
    assert s.numerics_changing(s.to_toggles({"quantize_base": "nf4"}))
    assert SearchSpace.for_device(Toggles(), H100, 32, memory=FULL_BATCH).choices["quantize_base"] == ("none",)
    assert SearchSpace.for_device(Toggles(), H100, 32).choices["quantize_base"] == ("none",)


def test_no_low_bit_optimizer_without_its_library(monkeypatch):
    monkeypatch.setattr(capabilities, "_installed", lambda module: module != "torchao")
    s = SearchSpace.for_device(Toggles(), CPU, 32, memory=FULL_BATCH)
    assert s.choices["optimizer"] == ("adamw", "adafactor")


def test_optimizer_and_base_are_tuned_on_one_process(torchao_and_bnb):
    s = SearchSpace.for_device(Toggles(), H100, 32, world_size=2, memory=FULL_BATCH, quantizable=True)
    assert s.choices["optimizer"] == ("adamw",) and s.choices["quantize_base"] == ("none",)
    assert s.choices["activation_checkpointing"] == (False, True)
    with pytest.raises(ConfigError, match="one process"):
        SearchSpace.for_device(Toggles(), H100, 32, world_size=2, spec="optimizer+=adafactor")
    with pytest.raises(ConfigError, match="one process"):
        SearchSpace.check_spec("optimizer=adamw,adafactor", Toggles(), 32, world_size=2)


def test_a_quantized_base_in_the_spec_needs_lora_on_a_model_directory(torchao_and_bnb):
    with pytest.raises(ConfigError) as e:
        SearchSpace.check_spec("quantize_base+=nf4", Toggles(), 32)
    assert e.value.option == "--tune-space" and "--lora R --model DIR" in e.value.message
    SearchSpace.check_spec("quantize_base+=nf4", Toggles(), 32, quantizable=True)
    with pytest.raises(ConfigError, match="not supported on cpu"):
        SearchSpace.for_device(Toggles(), CPU, 32, spec="quantize_base+=nf4", quantizable=True)


def test_memory_saving_order():
    assert capabilities.memory_saving("optimizer", "adamw") == ["adamw-8bit", "adamw-4bit", "adafactor"]
    assert capabilities.memory_saving("optimizer", "adafactor") == []
    assert capabilities.memory_saving("quantize_base", "none") == ["nf4", "int8"]
    assert capabilities.memory_saving("activation_checkpointing", False) == [True]
    assert capabilities.saves_memory(Toggles(optimizer="adamw-4bit"), Toggles())
    assert not capabilities.saves_memory(Toggles(optimizer="adamw"), Toggles(optimizer="adafactor"))
    assert set(MEMORY_SAVING) == {"activation_checkpointing", "optimizer", "quantize_base"}


def test_the_tuning_driver_widens_the_space_from_what_auto_found(torchao_and_bnb):
    from gptop.tuning_space import tuning_space

    cfg = TrainConfig()
    cfg.optim.global_batch = 32
    space, note = tuning_space(cfg, CPU, 8, 1, None, 60.0)  # --micro-batch auto found 8 of 32
    assert space.memory.startswith(FULL_BATCH)
    assert "memory is the constraint (the whole per-rank batch (32) does not fit" in note
    assert "optimizer adamw/adamw-8bit/adamw-4bit/adafactor" in note and "compile stays off" in note
    space, note = tuning_space(cfg, CPU, 32, 1, None, 60.0)  # it all fits: nothing traded
    assert space.memory is None and "memory" not in note and space.choices["optimizer"] == ("adamw",)
    cfg.toggles.micro_batch = 8  # asked for: not probed
    assert tuning_space(cfg, CPU, None, 1, None, 60.0)[0].memory is None


def test_best_toml_with_a_quantized_base_round_trips():
    t = Toggles(quantize_base="nf4", optimizer="adamw-8bit", micro_batch=8)
    check_best_toml(best_toml(t), t)


# --- a memory-constrained tuning, simulated -----------------------------------------------------------


def _memory_ctl(tmp_path, clock, spec):
    cfg = TrainConfig()
    cfg.data.seq_len = 128
    cfg.optim.global_batch = 32
    cfg.optim.max_steps = 50_000
    cfg.toggles.micro_batch = "auto"
    memory = memory_pressure(cfg, 8)
    space = SearchSpace.for_device(
        dataclasses.replace(cfg.toggles, micro_batch="auto"), CPU, 32, spec=spec, memory=memory
    )
    study = TuneStudy.open(cfg, CPU, space, storage=f"journal:{tmp_path}/tuning.log", seed=0, wall=clock)
    ctl = TuneController(
        cfg,
        CPU,
        space,
        study,
        Budget(3600.0, clock=clock),
        clock=clock,
        settings=TunerSettings(max_trials=12, min_steps=6, max_micro_batch=8),
    )
    return ctl, space


class MemoryTrainer:
    """Micro-batch 32 runs out of memory unless something saves memory; low-bit moments are slower per step but
    the whole batch in one pass wins; the 4-bit optimizer's loss drifts off the trend (caught by the check)."""

    def mem(self, t: Toggles) -> int:
        state = {"adamw": 8, "adamw-8bit": 2, "adamw-4bit": 1, "adafactor": 0}[t.optimizer] * 10**8
        act = t.micro_batch * 10**8 // (4 if t.activation_checkpointing else 1)
        return 10**9 + state + act

    def fits(self, t: Toggles) -> bool:
        return self.mem(t) <= 10**9 + 8 * 10**8 + 8 * 10**8  # what micro-batch 8 with adamw takes

    def step_ms(self, t: Toggles) -> float:
        ms = 400.0 * {8: 1.0, 32: 0.7}[t.micro_batch]
        ms *= 1.3 if t.activation_checkpointing else 1.0
        ms *= {"adamw": 1.0, "adamw-8bit": 1.05, "adamw-4bit": 1.05, "adafactor": 0.98}[t.optimizer]
        return ms

    @staticmethod
    def loss(step: int, t: Toggles) -> float:
        drift = 1.5 if t.optimizer == "adamw-4bit" else 0.0
        return 2.0 + 6.0 / (step + 1) ** 0.5 + drift


def _drive(ctl, clock, trainer):
    step, ckpt, seen = 0, 0, []
    for _ in range(30):
        step += 1
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=step,
                tokens=4096,
                loss=trainer.loss(step, Toggles()),
                lr=1e-3,
                grad_norm=1.0,
                step_ms=400.0,
                phases_ms={},
                tokens_per_s=1.0,
                mfu=0.0,
                mem_bytes=1_900_000_000,
            )
        )
    ckpt = step
    for _ in range(200):
        action = ctl.next_action()
        seen.append(action)
        if isinstance(action, FindMicroBatch):
            ctl.set_max_micro_batch(8)
            continue
        if isinstance(action, (RunTrial, Remeasure)):
            t = action.toggles
            if action.restart:
                clock.t += 5.0
                ctl.observe(make("checkpoint", step=ckpt, path="ckpt", seconds=1.0))
            step, stop = ckpt, None
            for i in range(5000):
                step += 1
                clock.t += trainer.step_ms(t) / 1000.0
                if not trainer.fits(t):
                    ctl.observe(
                        make(
                            "error",
                            kind="oom",
                            message="out of memory",
                            memory={"rss": 10**9, "rss_peak": trainer.mem(t), "total": 8 << 30},
                        )
                    )
                else:
                    ctl.observe(
                        make(
                            "step",
                            step=step,
                            tokens=4096,
                            loss=trainer.loss(step, t),
                            lr=1e-3,
                            grad_norm=1.0,
                            step_ms=trainer.step_ms(t),
                            phases_ms={},
                            tokens_per_s=0.0,
                            mfu=0.0,
                            mem_bytes=trainer.mem(t),
                            time=clock.t,
                        )
                    )
                stop = ctl.trial_should_stop()
                if stop:
                    break
            if stop in ("done", "prune", "budget") and action.keep_steps:
                ckpt = step
                ctl.finish_trial("ok")
            elif stop in ("done", "prune", "budget"):  # measured, then rolled back to ckpt
                ctl.finish_trial("ok", rollback={"step": ckpt, "path": "ckpt", "deleted": []})
            else:
                ctl.finish_trial(stop)
            continue
        if isinstance(action, (Apply, Done)):
            return seen
    raise AssertionError("the controller never finished")


SPACE = "-all micro_batch=8,32 activation_checkpointing=off,on optimizer=adamw,adamw-8bit,adamw-4bit,adafactor"


def test_a_memory_constrained_tuning_trades_memory_checks_the_loss_and_reports_peaks(tmp_path):
    clock = Clock()
    ctl, space = _memory_ctl(tmp_path, clock, SPACE)
    assert space.memory and space.memory.startswith(FULL_BATCH)
    trainer = MemoryTrainer()
    seen = _drive(ctl, clock, trainer)
    trials = [a for a in seen if isinstance(a, RunTrial) and not a.baseline]
    # the memory recipe is among the first: the whole batch, checkpointing on, the smallest AdamW variant
    memory_first = [a for a in trials if a.source == "memory"]
    assert memory_first and memory_first[0].toggles.micro_batch == 32
    assert memory_first[0].toggles.activation_checkpointing and memory_first[0].toggles.optimizer == "adamw-4bit"
    # low-bit optimizers are numerics-changing: their trials run under the loss check
    assert all(a.numerics_changing == (a.toggles.optimizer != "adamw") for a in trials)

    results = {r["number"]: r for r in ctl.record.results if r["kind"] == "trial"}
    by_toggles = {
        (r["toggles"].micro_batch, r["toggles"].activation_checkpointing, r["toggles"].optimizer): r
        for r in results.values()
    }
    # micro-batch 32 without a memory saver is screened as a predicted OOM (never run, no peak); with a
    # smaller optimizer it is tried, since the state it frees may make room
    screened = by_toggles[(32, False, "adamw")]
    assert screened["status"] == "infeasible" and "predicted OOM" in screened["reason"] and not screened["ran"]
    tried = by_toggles[(32, False, "adamw-8bit")]
    assert tried["ran"] and tried["failure"] == "oom"  # not screened: it had to be tried
    ran = [r for r in results.values() if r["ran"]]
    assert ran and all(r["peak_mem"] for r in ran)  # every trial that ran has its peak
    ooms = [r for r in ran if r["failure"] == "oom"]
    assert ooms
    for r in ooms:  # an OOM's peak comes from its error event
        t = r["toggles"]
        assert r["peak_mem"] == trainer.mem(t) and not trainer.fits(t)
    drifted = [r for r in ran if r["toggles"].optimizer == "adamw-4bit"]
    assert drifted and all(r["status"] == "infeasible" and r["failure"] == "diverged" for r in drifted)
    # a switch says what happens to the optimizer state (from what the kept checkpoint holds)
    assert any("the AdamW moments carry over from adamw to adamw-8bit" in r["reason"] for r in ran)
    to_ada = [r for r in ran if "adamw -> adafactor: the optimizer state cannot be converted" in r["reason"]]
    assert to_ada and all("adafactor starts with fresh state" in r["reason"] for r in to_ada)
    # such a trial is measured, then rolled back: the run keeps its AdamW state, so no later trial starts
    # AdamW fresh from an Adafactor checkpoint
    assert all(
        "rolled back to the pre-trial checkpoint so the run keeps its adamw state" in r["reason"] and r["rollback"]
        for r in to_ada
        if r["status"] != "infeasible"
    )
    assert not any("adafactor -> adamw" in r["reason"] for r in ran)

    info = ctl.report_info()
    assert info["memory"]["reason"] == space.memory
    assert info["memory"]["choices"]["optimizer"] == ["adamw", "adamw-8bit", "adamw-4bit", "adafactor"]
    report = build_report(ctl.study, info)
    md = render_markdown(report)
    assert "- Memory: the whole per-rank batch (32) does not fit" in md
    assert "so the space was widened to the memory-saving choices" in md
    assert "optimizer adamw, adamw-8bit, adamw-4bit, adafactor" in md
    rows = [
        line for line in md.splitlines() if line.startswith("| ") and "infeasible" in line and "out of memory" in line
    ]
    assert rows and all(" MiB |" in row or " GiB |" in row for row in rows)  # the OOM rows show their peak
    assert "memory-constrained: the whole per-rank batch" in format_summary(report)


def test_the_optimizer_state_note_follows_the_kept_checkpoint(tmp_path):
    """After an 8-bit trial is kept, the next trial converts from 8-bit; after a rolled-back one, from what the
    pre-trial checkpoint holds."""
    clock = Clock()
    ctl, _ = _memory_ctl(tmp_path, clock, SPACE)
    assert ctl.record.state_optimizer == "adamw"
    ctl.set_max_micro_batch(8)
    base = ctl.next_action()  # the baseline
    assert isinstance(base, RunTrial) and base.baseline
    for i in range(12):
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=31 + i,
                tokens=4096,
                loss=3.0,
                lr=1e-3,
                grad_norm=1.0,
                step_ms=400.0,
                phases_ms={},
                tokens_per_s=1.0,
                mfu=0.0,
                mem_bytes=10**9,
                time=clock.t,
            )
        )
    ctl.finish_trial("ok")
    assert ctl.record.state_optimizer == "adamw"
    first = ctl.next_action()
    assert isinstance(first, RunTrial)
    ctl.observe(make("error", kind="oom", message="out of memory", memory={"allocated_peak": 5 << 30}))
    ev = ctl.finish_trial("oom")
    assert ev.peak_mem == 5 << 30
    assert ctl.record.state_optimizer == "adamw"  # rolled back: the checkpoint still holds adamw's state


def test_a_start_that_runs_out_of_memory_widens_the_space_into_a_study_of_its_own(tmp_path, torchao_and_bnb):
    """An explicit micro-batch that passed the estimate but ran out of memory: the OOM path."""
    clock = Clock()
    cfg = TrainConfig()
    cfg.optim.global_batch = 32
    cfg.toggles.micro_batch = 32
    spec = "-compile -prefetch -workers -precision -attention -cuda_allocator -fused_adamw micro_batch=8,32"
    space = SearchSpace.for_device(cfg.toggles, CPU, 32, spec=spec)
    assert space.memory is None and space.choices["optimizer"] == ("adamw",)
    study = TuneStudy.open(cfg, CPU, space, storage=f"journal:{tmp_path}/tuning.log", seed=0, wall=clock)
    ctl = TuneController(
        cfg, CPU, space, study, Budget(3600.0, clock=clock), clock=clock, settings=TunerSettings(min_steps=4)
    )
    assert isinstance(ctl.next_action(), FindMicroBatch)
    ctl.set_max_micro_batch(None)  # an explicit micro-batch: nothing probed
    base = ctl.next_action()
    assert isinstance(base, RunTrial) and base.baseline and base.toggles.micro_batch == 32
    ctl.observe(
        make("error", kind="oom", message="out of memory: tried to allocate 2 GiB", memory={"rss_peak": 7 << 30})
    )
    ev = ctl.finish_trial("oom")
    assert ev.peak_mem == 7 << 30 and ev.status == "infeasible"
    assert ctl.space.memory.startswith("the starting configuration ran out of memory (out of memory: tried")
    assert ctl.space.choices["activation_checkpointing"] == (False, True)
    assert ctl.space.choices["optimizer"] == ("adamw", "adamw-8bit", "adamw-4bit", "adafactor")
    assert ctl.space.choices["compile"] == ("off",)  # the spec is replayed over the widened space
    assert ctl.study is not study and ctl.study.name != study.name
    assert ctl.study.storage_url == study.storage_url and ctl.study.run_id == study.run_id
    # the memory recipe is among the first trials of the new study
    first = ctl.next_action()
    assert isinstance(first, RunTrial) and ctl.space.contains(first.toggles)
    sources = [t.user_attrs.get("source") for t in ctl.study.trials()]
    assert "memory" in sources
    assert ctl.report_info()["memory"]["reason"] == ctl.space.memory


def test_a_reports_memory_field_is_checked_before_it_is_shown():
    from tuner.tuning_report import check_report

    assert check_report({"memory": {"reason": "x", "choices": {}}}) is None
    assert "'memory' is str" in check_report({"memory": "x"})
    assert "memory-constrained" not in format_summary({"memory": {"reason": 3}})


def test_stopping_tuning_during_a_fresh_state_trial_keeps_the_runs_optimizer(tmp_path):
    """The `t` key during a trial that switched to Adafactor: the session rolls it back (keep_steps False),
    so the run goes on with its AdamW state and the decision is made on what was measured."""
    clock = Clock()
    ctl, _ = _memory_ctl(tmp_path, clock, "-all optimizer=adamw,adafactor")
    ctl.set_max_micro_batch(8)
    ctl.next_action()  # the baseline, on the running process
    for i in range(12):
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=31 + i,
                tokens=4096,
                loss=3.0,
                lr=1e-3,
                grad_norm=1.0,
                step_ms=400.0,
                phases_ms={},
                tokens_per_s=1.0,
                mfu=0.0,
                mem_bytes=10**9,
                time=clock.t,
            )
        )
    ctl.finish_trial("ok")
    step = 43
    for _ in range(5):  # until the sampler proposes Adafactor
        trial = ctl.next_action()
        assert isinstance(trial, RunTrial)
        if trial.toggles.optimizer == "adafactor":
            break
        for _ in range(12):
            clock.t += 0.4
            step += 1
            ctl.observe(
                make(
                    "step",
                    step=step,
                    tokens=4096,
                    loss=3.0,
                    lr=1e-3,
                    grad_norm=1.0,
                    step_ms=400.0,
                    phases_ms={},
                    tokens_per_s=1.0,
                    mfu=0.0,
                    mem_bytes=10**9,
                    time=clock.t,
                )
            )
        ctl.trial_should_stop()
        ctl.finish_trial("ok")
    assert trial.toggles.optimizer == "adafactor" and not trial.keep_steps
    clock.t += 3.0
    done = ctl.stop_early("stopped by the user", rolled_back=True)
    assert done.toggles.optimizer == "adamw" and done.restart
    assert ctl.record.state_optimizer == "adamw" and ctl.record.rolled_back_s >= 3.0
