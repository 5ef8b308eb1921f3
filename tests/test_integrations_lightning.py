"""gptop.integrations.lightning: GptopCallback on a real Lightning Trainer, in-process against a fake gptop
channel. Lightning is an optional extra (`pip install 'gptop[lightning]'`): without it these tests skip."""

from __future__ import annotations

import math

import pytest

L = pytest.importorskip("lightning", reason="Lightning is an optional extra: pip install 'gptop[lightning]'")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gptop.integrations.lightning import GptopCallback  # noqa: E402
from trainer.contract import events as ev  # noqa: E402
from trainer.contract.client import CHANNEL_ENV  # noqa: E402
from trainer.contract.device import DeviceInfo  # noqa: E402

from fixtures.waiting import wait_for  # noqa: E402

VOCAB, SEQ, BATCH, ACCUM = 40, 12, 4, 2


class BigramLM(L.LightningModule):
    """A bigram language model: an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 24)
        self.head = torch.nn.Linear(24, VOCAB)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.head(self.emb(batch[:, :-1]))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(tmp_path, steps: int, callbacks: list, checkpointing: bool = False) -> L.Trainer:
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (steps * BATCH * ACCUM, SEQ))
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=ACCUM,
        default_root_dir=str(tmp_path / "pl"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpointing,
        log_every_n_steps=2,
        callbacks=callbacks,
    )
    trainer.fit(BigramLM(), train_dataloaders=DataLoader(data, batch_size=BATCH))
    return trainer


def test_outside_gptop_the_callback_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    cb = GptopCallback()
    assert fit(tmp_path, 3, [cb]).global_step == 3 and cb.client is None


def test_each_optimizer_step_is_reported_with_its_breakdown(gptop, tmp_path):
    fit(tmp_path, 6, [GptopCallback()])
    hello = gptop.file_events("hello")[0]
    assert hello.client == "lightning" and hello.max_steps == 6 and hello.model.family == "BigramLM"
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [2, 4, 6]
    for e in steps:
        assert list(e.phases_ms) == list(ev.PHASES)
        for phase in ("forward", "backward", "optimizer"):
            assert e.phases_ms[phase] > 0, phase
        timed = sum(v for k, v in e.phases_ms.items() if k != "other")
        assert math.isclose(e.phases_ms["other"], e.step_ms - timed, rel_tol=1e-6, abs_tol=1e-6)
        assert e.loss > 0 and e.grad_norm > 0 and e.lr == pytest.approx(1e-2)
        assert e.tokens == e.step * ACCUM * BATCH * SEQ
    done = gptop.file_events("done")
    assert len(done) == 1 and done[0].reason == "max_steps" and done[0].step == 6


def test_checkpoint_and_stop_commands(gptop, tmp_path):
    class Commander(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # the first micro-batches of steps 2 and 4
            command = {2: {"cmd": "checkpoint"}, 6: {"cmd": "stop"}}.get(batch_idx)
            if command is not None:
                gptop.send(command)
                wait_for(lambda: not cb.client.channel.commands.empty(), timeout=30, what="the command")

    cb = GptopCallback()
    trainer = fit(tmp_path, 100, [Commander(), cb])
    ckpts = gptop.file_events("checkpoint")
    assert [(c.step, c.reason) for c in ckpts] == [(2, "requested"), (4, "stop")]
    for c in ckpts:
        assert c.path.endswith(f"gptop-step={c.step}.ckpt")
        assert torch.load(c.path, weights_only=False)["global_step"] == c.step
    assert trainer.global_step == 4
    assert gptop.file_events("done")[0].reason == "stop requested"


def test_a_checkpoint_file_overwritten_is_reported_at_each_save_and_kept_once(gptop, tmp_path):
    """ModelCheckpoint's `last.ckpt` is written again at every save: each save is a checkpoint event (the
    newest says which step the file holds), and the report counts the file once."""
    from gptop.report import summarize

    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_last=True, save_top_k=-1
    )
    fit(tmp_path, 6, [GptopCallback(), every], checkpointing=True)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    saves = [c.step for c in gptop.file_events("checkpoint") if c.path == last]
    assert saves == [2, 4, 6], [(c.step, c.path) for c in gptop.file_events("checkpoint")]
    # the report of the run, as `gptop run` starts it (its early hello names the command)
    events = gptop.run_dir / "events.jsonl"
    early = ev.HelloEvent(
        early=True,
        pid=1,
        config={},
        device=DeviceInfo(type="cpu", name="cpu"),
        model=ev.ModelInfo(),
        command=["python", "pl.py"],
    )
    events.write_text(ev.dumps(early) + "\n" + events.read_text())
    kept = summarize(gptop.run_dir)["checkpoints_kept"]
    assert [k["path"] for k in kept].count(last) == 1 and {"step": 6, "path": last} in kept
