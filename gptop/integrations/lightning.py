"""gptop for a Lightning run: `GptopCallback` (`pip install 'gptop[lightning]'`).

    from gptop.integrations.lightning import GptopCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[GptopCallback()])
    trainer.fit(model, train_dataloaders=loader)

Each optimizer step (`trainer.global_step`) is reported with its breakdown, from Lightning's callback hooks:

- data: from the end of the previous batch to `on_train_batch_start` (the loop fetches the batch in between);
- forward: `on_train_batch_start` -> `on_before_backward` (training_step, and zero_grad, which the closure
  runs between them), summed over gradient accumulation;
- backward: `on_before_backward` -> `on_after_backward`;
- optimizer: `on_before_optimizer_step` -> `on_train_batch_end`;
- other: what the step's time leaves.

The loss is the training_step's (`outputs["loss"]`, kept on the device and read back at log steps, averaged
over the ranks), the learning rate the first optimizer's, the gradient norm computed on the device at log
steps only; tokens are the batch's `input_ids` (or first tensor) elements for integer token ids, else its
samples. gptop's checkpoint command saves `trainer.save_checkpoint` into the ModelCheckpoint's directory
(else `default_root_dir/checkpoints`) as `gptop-step=N.ckpt`; its stop saves there and sets
`trainer.should_stop`. Saves of the run's own ModelCheckpoint are reported too, each save of a file it
overwrites (`last.ckpt`) again. Outside gptop every hook returns at once.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    try:
        # no-redef where both packages are installed for the type checker; unused where neither is
        import pytorch_lightning as pl  # type: ignore[no-redef, unused-ignore]
    except ImportError:
        raise ImportError("gptop.integrations.lightning needs Lightning: pip install 'gptop[lightning]'") from None

from trainer.contract.client import ClientEnv, ClientKind

from .client import DEFAULT_LOG_EVERY, Client, describe_model, model_precision, module_device


def _batch_ids(batch: Any) -> torch.Tensor | None:
    """The tensor a batch is measured by: `input_ids` of a mapping, the batch itself, or its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        v = batch.get("input_ids")
        if isinstance(v, torch.Tensor):
            return v
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((v for v in batch if isinstance(v, torch.Tensor)), None)
    return None


def _tokens(ids: torch.Tensor | None) -> int:
    """Token ids: their elements; anything else (images, features): its samples."""
    if ids is None or ids.dim() == 0:
        return 0
    if not ids.is_floating_point() and ids.dim() >= 2:
        return ids.numel()
    return int(ids.shape[0])


def _mtime(path: str) -> int | None:
    """When the file at `path` was last written (None: it is not there)."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _precision(trainer: Any, module: torch.nn.Module, device: torch.device) -> str:
    p = str(getattr(trainer, "precision", ""))
    if "bf16" in p:
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    return model_precision(module, device)


class GptopCallback(pl.Callback):
    """Reports a Lightning run to gptop (see the module docstring); a no-op outside gptop.

    `flops_per_token`: FLOPs per trained token when the count from the module's parameters is not right.
    `log_every`: steps between step events when gptop gives none (default: `Trainer(log_every_n_steps)`)."""

    def __init__(self, *, flops_per_token: float | None = None, log_every: int | None = None):
        super().__init__()
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"GptopCallback(log_every={log_every!r}): a whole number of at least 1, or None")
        self.flops_per_token, self.log_every = flops_per_token, log_every
        self.env = ClientEnv.from_environ()
        self.client: Client | None = None
        self._module: torch.nn.Module | None = None
        self._global_step = 0
        self._saved: dict[str, int | None] = {}  # files already reported, with their mtime then

    # ------------------------------------------------------------------ start and end
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.env is None or self.client is not None:
            return
        device = module_device(pl_module)
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if max_steps is None:
            est = trainer.estimated_stepping_batches
            max_steps = int(est) if isinstance(est, (int, float)) and est != float("inf") else None
        self.client = Client.connect(
            self.env,
            ClientKind.LIGHTNING,
            device=device,
            log_every=self.log_every or trainer.log_every_n_steps or DEFAULT_LOG_EVERY,
            max_steps=max_steps,
            precision=_precision(trainer, pl_module, device),
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            reduce_loss=True,
            start_step=trainer.global_step,
        )
        if self.client is None:
            return
        self._module = pl_module
        self._global_step = trainer.global_step
        self._saved = {p: _mtime(p) for p in self._checkpoint_files(trainer)}  # already there: not this run's news
        self._next_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        client = self.client
        if client is None:
            return
        self._report_saves(trainer)
        client.abandon_step()
        if not client.said_hello:
            client.hello(describe_model(pl_module, flops_per_token=self.flops_per_token))
        reached = client.max_steps is not None and trainer.global_step >= client.max_steps
        client.done(
            None
            if client.should_stop or reached or trainer.max_steps in (None, -1)
            else "Lightning stopped (trainer.should_stop)"
        )
        client.close()
        self.client, self._module = None, None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.client is not None:
            self.client.error(exception)

    # ------------------------------------------------------------------ a step
    def _next_step(self) -> None:
        assert self.client is not None
        self.client.begin_step(self._global_step + 1)
        self.client.enter("data")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        client = self.client
        if client is None:
            return
        ids = _batch_ids(batch)
        if not client.said_hello:
            seq_len = int(ids.shape[-1]) if ids is not None and ids.dim() >= 2 and not ids.is_floating_point() else None
            client.hello(describe_model(pl_module, seq_len=seq_len, flops_per_token=self.flops_per_token))
        client.add_tokens(_tokens(ids))
        client.leave("data")
        client.enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.client is not None:
            self.client.leave("forward")
            self.client.enter("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.client is not None:
            self.client.leave("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        client = self.client
        if client is None:
            return
        client.leave("backward")
        if client.is_log_step(self._global_step + 1):  # a device op, read back with the loss
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                client.log(
                    grad_norm=torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
                    )
                )
        client.enter("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        client = self.client
        if client is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            client.log(loss=loss.detach())
        if trainer.global_step == self._global_step:  # a micro-batch of gradient accumulation
            client.leave("optimizer")
            client.enter("data")
            return
        self._global_step = trainer.global_step
        self._report_saves(trainer)
        client.end_step()
        client.poll()
        if client.is_log_step():
            client.flush()
        if client.should_checkpoint or client.should_stop:
            path = os.path.join(self._checkpoint_dir(trainer), f"gptop-step={trainer.global_step}.ckpt")
            t = time.perf_counter()
            trainer.save_checkpoint(path)  # every rank: Lightning saves on rank 0
            client.checkpointed(path, seconds=time.perf_counter() - t)
            self._saved[path] = _mtime(path)
        if client.should_stop:
            trainer.should_stop = True
        self._next_step()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.client is not None:
            self._report_saves(trainer)
            self.client.restart_step()  # validation ran since the boundary: not the next step's data wait
            self.client.enter("data")

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _checkpoint_dir(trainer: Any) -> str:
        cb = trainer.checkpoint_callback
        dirpath = getattr(cb, "dirpath", None) if cb is not None else None
        return str(dirpath) if dirpath else os.path.join(trainer.default_root_dir, "checkpoints")

    @staticmethod
    def _checkpoint_files(trainer: Any) -> set[str]:
        out = set()
        for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
            for attr in ("last_model_path", "best_model_path"):
                path = getattr(cb, attr, None)
                if path:
                    out.add(str(path))
        return out

    def _report_saves(self, trainer: Any) -> None:
        """The run's own ModelCheckpoint saves since the last look: checkpoint events, a file it overwrote
        (`last.ckpt`) again for each save."""
        client = self.client
        if client is None:
            return
        for path in sorted(self._checkpoint_files(trainer)):
            mtime = _mtime(path)
            if mtime is not None and self._saved.get(path) != mtime:
                self._saved[path] = mtime
                client.checkpointed(path, reason="interval")
