"""gptop.integrations.transformers: GptopCallback on a real transformers.Trainer, in-process against a fake gptop
channel. The training here is not the example's (examples/train_transformers.py): a GPT-2 from its config, a
dataset class of its own that also hands out attention masks, 4 sequences per device with 2 accumulation steps.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.data import Dataset
import transformers  # lazy: its names, and gptop.integrations.transformers (imported in the tests), load in seconds

from trainer.contract import events as ev
from trainer.contract.client import CHANNEL_ENV, RESUME_ENV

from fixtures.fake_gptop import FakeGptop
from helpers import wait_for

SEQ, BATCH, ACCUM = 16, 4, 2


class Palindromes(Dataset):
    """Sequences that read the same backwards, with their attention mask (all ones)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        half = torch.randint(50, (n, SEQ // 2), generator=g)
        self.ids = torch.cat([half, half.flip(1)], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_trainer(tmp_path, steps: int, callbacks: list) -> transformers.Trainer:
    from gptop.integrations.transformers import (
        tuned_args,
    )

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    )
    args = tuned_args(
        transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=steps,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUM,
            learning_rate=1e-3,
            logging_steps=2,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=Palindromes(steps * BATCH * ACCUM), callbacks=callbacks
    )


def losses(trainer: transformers.Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
def test_outside_gptop_the_callback_changes_nothing(tmp_path, monkeypatch):
    from gptop.integrations.transformers import (
        GptopCallback,
        resume_checkpoint,
    )

    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    plain = make_trainer(tmp_path / "a", 6, [])
    plain.train()
    cb = GptopCallback()
    with_cb = make_trainer(tmp_path / "b", 6, [cb])
    with_cb.train(resume_from_checkpoint=resume_checkpoint(with_cb.args))
    assert cb.client is None and resume_checkpoint(with_cb.args) is None
    assert losses(with_cb) == losses(plain) and len(losses(plain)) == 3


@pytest.mark.slow
def test_each_optimizer_step_is_reported_with_its_breakdown(gptop, tmp_path):
    from gptop.integrations.transformers import (
        GptopCallback,
    )

    trainer = make_trainer(tmp_path, 6, [GptopCallback()])
    trainer.train()
    hello = gptop.file_events("hello")[0]
    assert hello.client == "transformers" and hello.max_steps == 6 and hello.config["log"]["log_every"] == 2
    assert hello.model.family == "GPT2LMHeadModel"
    assert hello.model.flops_per_token == describe(trainer.model)  # with the attention term at SEQ
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [2, 4, 6]  # the Trainer's logging_steps
    logged = losses(trainer)
    for e, loss in zip(steps, logged):
        assert e.loss == pytest.approx(loss) and e.lr is not None and e.grad_norm is not None
        assert list(e.phases_ms) == list(ev.PHASES)
        for phase in ("forward", "backward", "optimizer"):
            assert e.phases_ms[phase] > 0, phase
        timed = sum(v for k, v in e.phases_ms.items() if k != "other")
        assert math.isclose(e.phases_ms["other"], e.step_ms - timed, rel_tol=1e-6, abs_tol=1e-6)
        assert e.tokens == e.step * BATCH * ACCUM * SEQ  # every micro-batch's tokens
    live = [e.step for e in gptop.events("progress")]
    assert live[0] == 1 and live == sorted(set(live)) and set(live) <= set(range(1, 7))
    done = gptop.file_events("done")
    assert len(done) == 1 and done[0].reason == "max_steps" and done[0].step == 6


def describe(model) -> int:
    from trainer.models import training_flops_per_token

    return training_flops_per_token(model, model.config, SEQ)


@pytest.mark.slow
def test_gptops_log_interval_makes_the_trainer_log(tmp_path, monkeypatch):
    from gptop.integrations.transformers import (
        GptopCallback,
    )

    gptop = FakeGptop(tmp_path / "run", log_every=3).install(monkeypatch)  # gptop run --log-every 3
    try:
        trainer = make_trainer(tmp_path, 6, [GptopCallback()])
        trainer.train()
        assert [e.step for e in gptop.file_events("step")] == [3, 6]
        assert {h["step"] for h in trainer.state.log_history if "loss" in h} >= {3, 6}
    finally:
        gptop.close()


@pytest.mark.slow
def test_checkpoint_and_stop_commands(gptop, tmp_path):
    from gptop.integrations.transformers import (
        GptopCallback,
    )

    class Commander(transformers.TrainerCallback):  # plays gptop's keys, just before the callback looks
        def on_step_end(self, args, state, control, **kw):
            command = {1: {"cmd": "checkpoint"}, 3: {"cmd": "stop"}}.get(state.global_step)
            if command is not None:
                gptop.send(command)
                wait_for(lambda: not cb.client.channel.commands.empty(), timeout=30, what="the command")

    cb = GptopCallback()
    trainer = make_trainer(tmp_path, 100, [Commander(), cb])
    trainer.train()
    assert trainer.state.global_step == 3  # the stop came at step 3's end: saved and stopped there
    ckpts = gptop.file_events("checkpoint")
    assert [(c.step, c.reason) for c in ckpts] == [(1, "requested"), (3, "stop")]
    for c in ckpts:
        assert c.path.endswith(f"checkpoint-{c.step}") and (tmp_path / "out" / f"checkpoint-{c.step}").is_dir()
    assert gptop.file_events("done")[0].reason == "stop requested"


class SlowEval(Palindromes):
    """An evaluation set that takes EVAL_S to read: an evaluation far longer than a save of the tiny model."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(EVAL_S / len(self))
        return super().__getitem__(i)


EVAL_S = 1.6


@pytest.mark.slow
def test_a_checkpoints_duration_is_the_save_not_the_evaluation_before_it(gptop, tmp_path):
    from gptop.integrations.transformers import GptopCallback

    trainer = make_trainer(tmp_path, 4, [GptopCallback()])
    trainer.args.eval_strategy, trainer.args.eval_steps = "steps", 2
    trainer.args.save_strategy, trainer.args.save_steps = "steps", 2
    trainer.eval_dataset = SlowEval(8)
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 4]  # before each save
    ckpts = gptop.file_events("checkpoint")
    assert [c.step for c in ckpts] == [2, 4]
    assert all(0 < c.seconds < EVAL_S / 2 for c in ckpts), [c.seconds for c in ckpts]


def test_tuned_args_and_resume_checkpoint(tmp_path, monkeypatch):
    from gptop.integrations.transformers import (
        resume_checkpoint,
        tuned_args,
    )

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert tuned_args(args) is args
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    assert resume_checkpoint(args) is None
    g = FakeGptop(tmp_path / "run").install(monkeypatch)
    try:
        assert resume_checkpoint(args) is None  # gptop run restarts from nothing of yours
        monkeypatch.setenv(RESUME_ENV, str(tmp_path / "checkpoint-4"))
        assert resume_checkpoint(args) == str(tmp_path / "checkpoint-4")
    finally:
        g.close()


@pytest.mark.slow
def test_a_resume_restores_every_weight_of_gptops_checkpoint(gptop, tmp_path, monkeypatch):
    """GPT-NeoX saves its output layer as `embed_out` and, in transformers 5, names it `lm_head`: the Trainer's
    resume loads the raw file and leaves lm_head at its initialization (the loss jumps back to where it
    started). The callback fingerprints the weights of every checkpoint gptop asks for and, on a resume,
    loads what the Trainer left out with from_pretrained, saying so: the resumed run's losses are the
    uninterrupted run's."""
    from gptop.integrations.transformers import (
        GptopCallback,
        resume_checkpoint,
        tuned_args,
    )
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from gptop.integrations.transformers import WEIGHTS_FILE

    def neox_trainer(out, steps, callbacks):
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(
            GPTNeoXConfig(
                vocab_size=50,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=SEQ,
            )
        )
        args = tuned_args(
            transformers.TrainingArguments(
                output_dir=str(out),
                max_steps=steps,
                per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUM,
                learning_rate=1e-3,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                disable_tqdm=True,
                seed=0,
            )
        )
        return transformers.Trainer(
            model=model, args=args, train_dataset=Palindromes(steps * BATCH * ACCUM), callbacks=callbacks
        )

    class Commander(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                gptop.send({"cmd": "checkpoint"})
                wait_for(lambda: not cb.client.channel.commands.empty(), timeout=30, what="the command")

    cb = GptopCallback()
    whole = neox_trainer(tmp_path / "out", 6, [Commander(), cb])
    whole.train()
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert (ckpt / WEIGHTS_FILE).is_file()
    monkeypatch.setenv(RESUME_ENV, str(ckpt))
    resumed = neox_trainer(tmp_path / "out", 6, [GptopCallback()])
    resumed.train(resume_from_checkpoint=resume_checkpoint(resumed.args))
    assert losses(resumed)[-3:] == pytest.approx(losses(whole)[-3:], rel=1e-4)
    said = [e.message for e in gptop.file_events("warning")]
    assert any("without restoring lm_head.weight" in m and "from_pretrained" in m for m in said), said


def tune_trainer(tmp_path, steps: int, callbacks: list, **args) -> transformers.Trainer:
    """A trainer as `gptop tune -- CMD` starts one: built through tuned_args, trained with resume_checkpoint."""
    from gptop.integrations.transformers import tuned_args

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    )
    training = tuned_args(
        transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=steps,
            per_device_train_batch_size=BATCH,
            learning_rate=1e-3,
            logging_steps=2,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            **args,
        )
    )
    return transformers.Trainer(
        model=model, args=training, train_dataset=Palindromes(steps * BATCH), callbacks=callbacks
    )


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [3, 4])
def test_a_stop_for_a_switch_ends_the_process_as_train_returns(gptop, tmp_path, monkeypatch, stop_at):
    """Under gptop tune, the tuner's stop (a command, and the signal gptop sends with it) saves and ends the
    process with exit code 0 as train() returns: what the script does after train() runs once, at the run's
    real end. The stop's checkpoint is gptop's to move ("stop") unless the Trainer saves at that step on its
    own (save_steps=2: step 4), where it stays the script's ("interval")."""
    import os
    import signal

    from gptop.integrations.transformers import GptopCallback, resume_checkpoint
    from trainer.contract.client import TUNE_ENV

    monkeypatch.setenv(TUNE_ENV, "1")

    class Tuner(transformers.TrainerCallback):  # the tuner's stop: SIGINT first, then its words over the channel
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == stop_at:
                os.kill(os.getpid(), signal.SIGINT)
                wait_for(lambda: not cb.client.channel.commands.empty(), timeout=30, what="the signal")
                gptop.send({"cmd": "stop", "reason": ev.TUNER_RESTART})

    cb = GptopCallback()
    trainer = tune_trainer(tmp_path, 100, [Tuner(), cb], save_steps=2, save_total_limit=3)
    after = []
    with pytest.raises(SystemExit) as ended:
        trainer.train(resume_from_checkpoint=resume_checkpoint(trainer.args))
        after.append("the script's work after train()")
    assert ended.value.code == 0 and after == [] and trainer.state.global_step == stop_at
    ckpts = [(c.step, c.reason) for c in gptop.file_events("checkpoint")]
    own = [(2, "interval"), (4, "interval")][: stop_at // 2]
    assert ckpts == (own if stop_at == 4 else own + [(3, "stop")])
    assert gptop.file_events("done")[0].reason == ev.TUNER_RESTART


@pytest.mark.slow
@pytest.mark.parametrize("during_a_switch", [False, True])
def test_a_users_stop_under_gptop_tune_returns_from_train(gptop, tmp_path, monkeypatch, during_a_switch):
    """Your stop (q, Ctrl-C) ends the run: train() returns and the script's own end runs, also when it comes
    while gptop stops the process for a switch."""
    from gptop.integrations.transformers import GptopCallback, resume_checkpoint
    from trainer.contract.client import TUNE_ENV

    monkeypatch.setenv(TUNE_ENV, "1")

    class User(transformers.TrainerCallback):  # q: the session's stop, in its own words
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                if during_a_switch:
                    gptop.send({"cmd": "stop", "reason": ev.TUNER_RESTART})
                gptop.send({"cmd": "stop", "reason": "stop requested"})  # as gptop.supervisor sends it
                wait_for(lambda: not cb.client.channel.commands.empty(), timeout=30, what="the command")

    cb = GptopCallback()
    trainer = tune_trainer(tmp_path, 100, [User(), cb], save_strategy="no")
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer.args))  # returns: the script's end runs
    assert trainer.state.global_step == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, named", [({"save_total_limit": 1}, "save_total_limit=1"), ({"ignore_data_skip": True}, "ignore_data_skip")]
)
def test_arguments_that_would_lose_a_tunes_work_are_refused(gptop, tmp_path, monkeypatch, args, named):
    from gptop.integrations.transformers import GptopCallback, resume_checkpoint
    from trainer.contract.client import TUNE_ENV

    monkeypatch.setenv(TUNE_ENV, "1")
    trainer = tune_trainer(tmp_path, 4, [GptopCallback()], **args)
    with pytest.raises(SystemExit) as refused:
        trainer.train(resume_from_checkpoint=resume_checkpoint(trainer.args))
    assert refused.value.code == 1 and trainer.state.global_step == 0
    (err,) = gptop.file_events("error")
    assert err.kind == "config" and named in err.message and "\n" not in err.message


def test_a_client_announces_itself_on_import_under_gptop_tune_only(tmp_path, monkeypatch):
    from gptop.integrations import announce
    from trainer.contract.client import TUNE_ENV

    g = FakeGptop(tmp_path / "run").install(monkeypatch)
    try:
        monkeypatch.delenv(TUNE_ENV, raising=False)
        announce()  # gptop run: nothing
        monkeypatch.setenv(TUNE_ENV, "1")
        assert not g.conns
        announce()
        wait_for(lambda: g.conns, timeout=10, what="the announcement")
        assert g.received == []  # a connection, no event
    finally:
        g.close()
