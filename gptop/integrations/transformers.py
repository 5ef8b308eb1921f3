"""gptop for a `transformers.Trainer` script: `GptopCallback`, `tuned_args`, `resume_checkpoint`.

    from gptop.integrations.transformers import GptopCallback, tuned_args, resume_checkpoint

    args = tuned_args(TrainingArguments(...))          # the tuner's toggles applied; unchanged outside gptop
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GptopCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args))   # None unless gptop restarts the run

Each optimizer step is reported with its breakdown, taken from the Trainer's callbacks and two hooks on the
model (a forward pre-hook and a forward hook):

- data: from the end of the previous step (after its logging, evaluation or saving) to `on_step_begin`,
  which the Trainer calls once the step's batches are fetched;
- forward: the model's forward, per micro-batch (summed over gradient accumulation);
- backward: from the end of a forward to the next forward or `on_pre_optimizer_step`; it includes the
  gradient clipping, which the Trainer runs there with no callback of its own;
- optimizer: `on_pre_optimizer_step` -> `on_optimizer_step`;
- other: what the step's time leaves (the learning-rate scheduler, zero_grad, the callbacks).

Loss, learning rate and gradient norm come from the Trainer's own logs (`on_log`), so nothing is read from
the device that the Trainer does not read itself; at gptop's log steps (`gptop run --log-every`, else the
Trainer's `logging_steps`) the callback asks the Trainer to log. Tokens come from the shape of the batch the
model is called with (`input_ids`, else `inputs_embeds`). gptop's checkpoint command becomes
`control.should_save`, its stop `should_save` and `should_training_stop`. Outside gptop every callback returns
at once.

Under `gptop tune -- CMD` a process gptop stops for a switch (a trial, the decision) ends as `trainer.train()`
returns: once the callback has reported the end, it raises SystemExit(0) from `on_train_end`, so what the script
does after `train()` (saving, evaluating, a model card) runs once, in the process that trains to the run's end
(or that you stop), never at each switch. SystemExit unwinds as an ordinary exit: `finally` blocks, atexit
handlers and the DataLoader workers' shutdown run, and the exit code is 0. The callbacks after this one in the
Trainer's list get no `on_train_end` in such a process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer.contract.atomic import atomic_write
from trainer.contract.client import ClientEnv, ClientKind

from .client import DEFAULT_LOG_EVERY, Client, describe_model, model_precision, module_device
from .loop_hooks import token_ids

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR: <output_dir>/checkpoint-N


# Which of the two calls this process made: `gptop tune -- CMD` restarts the script with toggles and a
# checkpoint, which reach the Trainer only through them (GptopCallback refuses a tune without them).
_called: set[str] = set()
TUNE_CALLS = ("tuned_args", "resume_checkpoint")
TUNE_USAGE = (
    "args = tuned_args(TrainingArguments(...)) and trainer.train(resume_from_checkpoint="
    'resume_checkpoint(args)) (docs/your-code.md, "Tuning your script")'
)


def tuned_args(args: TrainingArguments) -> TrainingArguments:
    """`args` with the toggles gptop's tuner chose applied (trainer.contract.training_args maps them to
    fields: precision, torch_compile, per_device_train_batch_size with gradient_accumulation_steps keeping
    the batch of an optimizer step, the DataLoader's workers and prefetch, fused AdamW, gradient
    checkpointing). Outside `gptop tune`, and in the process it measures as the start, `args` unchanged."""
    from trainer.contract.training_args import args_fields, read_fields

    _called.add("tuned_args")
    env = ClientEnv.from_environ()
    if env is None or env.toggles is None:
        return args
    change = args_fields(env.toggles, read_fields(args))
    return dataclasses.replace(args, **change) if change else args


def resume_checkpoint(args: TrainingArguments) -> str | None:
    """The checkpoint gptop restarts this run from (`trainer.train(resume_from_checkpoint=...)`), or None: a
    fresh start, and always outside gptop. `gptop tune -- CMD` restarts the script from the checkpoint the
    callback saved on its command, for each trial and for the setting it applies."""
    _called.add("resume_checkpoint")
    env = ClientEnv.from_environ()
    return None if env is None else env.resume


def tuning_refusal(env: ClientEnv, args: TrainingArguments, state: TrainerState) -> str | None:
    """Why this process cannot be tuned the way gptop asked (None: it can): a call missing, a checkpoint
    the Trainer did not resume from, or toggles the Trainer was not given."""
    from trainer.contract.training_args import args_fields, read_fields

    missing = [c for c in TUNE_CALLS if c not in _called]
    if missing:
        return (
            f"gptop tune: the script does not call {' or '.join(missing)} from "
            f"gptop.integrations.transformers, so gptop cannot hand it a trial's settings or checkpoint; "
            f"use {TUNE_USAGE}"
        )
    if args.save_total_limit == 1:
        return (
            "gptop tune: save_total_limit=1 keeps one checkpoint: the Trainer deletes the previous one at each save "
            "and, with a best model, every other one each time train() returns, which under gptop tune is every "
            "switch; use save_total_limit=2 or more, or none"
        )
    if args.ignore_data_skip:
        return (
            "gptop tune: ignore_data_skip=True makes a resumed Trainer train on other samples than the run would, "
            "so each switch would change what the run learns; leave it False"
        )
    if env.resume is not None and state.global_step == 0:
        return (
            f"gptop tune: the Trainer did not resume from {env.resume}; pass resume_checkpoint(args) to "
            f"trainer.train(resume_from_checkpoint=...)"
        )
    if env.toggles is not None:
        # the fields the toggles map to, not the toggles read back: toggles that run the same arguments
        # (a prefetch factor without workers) are the same
        try:
            off = sorted(args_fields(env.toggles, read_fields(args)))
        except ValueError as e:
            off = [str(e)]
        if off:
            return (
                f"gptop tune: the Trainer's arguments are not tuned_args's ({', '.join(off)} differ); give "
                f"the Trainer the TrainingArguments tuned_args returned, and do not change them after"
            )
    return None


WEIGHTS_FILE = "gptop-weights.json"  # in each checkpoint gptop asked for: what its weights look like


def weights_fingerprint(model: torch.nn.Module) -> dict[str, list[float]] | None:
    """Per parameter, the float64 sum and sum of squares of its values: enough to tell that a resume restored
    a checkpoint's weights. None where the parameters are not whole local tensors (sharded, on `meta`)."""
    out: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type == "meta" or p.numel() == 0 or hasattr(p, "device_mesh"):
                return None
            x = p.detach().to(torch.float64)
            out[name] = [float(x.sum()), float((x * x).sum())]
    return out


def differing(saved: dict[str, list[float]], now: dict[str, list[float]], rel: float = 1e-6) -> list[str]:
    """The parameters whose fingerprints differ (beyond float64 reduction noise), or that one side lacks."""
    off = [n for n in saved.keys() | now.keys() if n not in saved or n not in now]
    for n in saved.keys() & now.keys():
        if any(abs(a - b) > rel * max(1.0, abs(a)) for a, b in zip(saved[n], now[n])):
            off.append(n)
    return sorted(off)


class GptopCallback(TrainerCallback):
    """Reports a transformers.Trainer run to gptop (see the module docstring); a no-op outside gptop.

    `flops_per_token`: FLOPs per trained token (forward + backward) when the count from the model's
    parameters and config is not right for it. `log_every`: steps between step events when gptop gives none
    (default: the Trainer's `logging_steps`)."""

    def __init__(self, *, flops_per_token: float | None = None, log_every: int | None = None):
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"GptopCallback(log_every={log_every!r}): a whole number of at least 1, or None")
        self.flops_per_token, self.log_every = flops_per_token, log_every
        self.env = ClientEnv.from_environ()
        self.client: Client | None = None
        self._model: torch.nn.Module | None = None
        self._hooks: list[Any] = []
        self._flush_due = False
        self._mark = time.perf_counter()  # where the data wait of the next step began
        self._args: TrainingArguments | None = None
        self._tunable: list[str] | None = None
        self._own_save = False  # the Trainer saves at this step on its own too (its interval, its last step)

    # ------------------------------------------------------------------ start and end
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.env is None or self.client is not None:
            return
        device = module_device(model)
        precision = (
            "bf16" if args.bf16 else "fp16" if args.fp16 else "tf32" if args.tf32 else model_precision(model, device)
        )
        logging_steps = int(state.logging_steps) if state.logging_steps and state.logging_steps >= 1 else None
        self.client = Client.connect(
            self.env,
            ClientKind.TRANSFORMERS,
            device=device,
            log_every=self.log_every or logging_steps or DEFAULT_LOG_EVERY,
            max_steps=state.max_steps or None,
            precision=precision,
            optimizer=optimizer,
            reduce_loss=False,
            start_step=state.global_step,
        )
        if self.client is None:
            return
        from trainer.contract.training_args import read_fields, tunable

        why = None
        if self.env.tune:
            why = tuning_refusal(self.env, args, state)
        if why is None and self.env.resume is not None and model is not None:
            why = self._restored(model, self.env.resume)
        if why is not None:
            self.client.refuse(why)
            self.client.close()
            self.client = None
            raise SystemExit(1)
        fields = read_fields(args)
        self._tunable = tunable(fields)
        self._args = args
        self._model = model
        if model is not None:
            self._hooks = [
                model.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
                model.register_forward_hook(self._forward_ends),
            ]
        self._next_step(state)

    def _restored(self, model: torch.nn.Module, checkpoint: str) -> str | None:
        """None when `model` holds the weights gptop's checkpoint had (repairing a partial load first), else
        why the run cannot go on. transformers' resume loads the raw file into the model, without the key
        renames `from_pretrained` applies (GPT-NeoX's `embed_out` became `lm_head` in transformers 5): a
        renamed weight stays at its initialization and the run loses what it learned, silently."""
        try:
            saved = json.loads(Path(checkpoint, WEIGHTS_FILE).read_text())
        except (OSError, ValueError):
            return None  # a checkpoint gptop did not fingerprint: nothing to compare with
        now = weights_fingerprint(model)
        if now is None or not isinstance(saved, dict):
            return None
        off = differing(saved, now)
        if not off:
            return None
        named = ", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        if isinstance(model, PreTrainedModel):
            fresh = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)
            model.load_state_dict(fresh.state_dict(), strict=False)
            del fresh
            again = weights_fingerprint(model)
            if again is not None and not differing(saved, again):
                assert self.client is not None
                self.client.warn(
                    f"transformers resumed from {checkpoint} without restoring {named} (the "
                    f"checkpoint names them otherwise); gptop loaded them with "
                    f"{type(model).__name__}.from_pretrained, so every weight is the checkpoint's"
                )
                return None
        return (
            f"the Trainer resumed from {checkpoint} but {named} are not the checkpoint's weights: training on "
            f"would lose what the run learned. Load the model so that Trainer(resume_from_checkpoint=...) "
            f"restores it (its state_dict keys as saved), or run without gptop's restarts (gptop run)"
        )

    def _hello(self, client: Client, model: torch.nn.Module | None, seq_len: int | None = None) -> None:
        """The hello, with what the tuner starts from: the Trainer's arguments as toggles, the batch of an
        optimizer step over all processes, the sequence length, and which toggles the script can take."""
        from trainer.contract.training_args import per_device_batch, read_fields, start_toggles

        desc = describe_model(model, seq_len=seq_len, flops_per_token=self.flops_per_token)
        config: dict[str, dict[str, Any]] = {}
        extra: dict[str, Any] = {}
        if self._args is not None:
            fields = read_fields(self._args)
            toggles = start_toggles(fields, tf32_on=client.precision == "tf32")  # fp32 with TF32 is tf32
            config["toggles"] = dataclasses.asdict(toggles)
            config["optim"] = {"global_batch": per_device_batch(fields) * client.world}
            name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
            config["model"] = {"model": f"{name}-{desc.get('total_params') or 0}p"}
            extra = dict(
                micro_batch=toggles.micro_batch_int(),
                accumulation=int(fields.get("gradient_accumulation_steps") or 1),
                tunable=self._tunable,
            )
        if seq_len:
            config["data"] = {"seq_len": seq_len}
        if self.env is not None and self.env.resume is not None:
            extra["resumed_from"] = self.env.resume  # the checkpoint gptop restarted it from
        client.hello(desc, config=config, **extra)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        client = self.client
        if client is None:
            return
        client.abandon_step()  # the step begun after the last one is not taken
        if self.env is not None and self.env.tune:
            client.poll()  # the tuner's stop command may come after its signal: its words say it is a switch
        if not client.said_hello:
            self._hello(client, self._model)
        reason = (
            None
            if client.should_stop or state.global_step >= state.max_steps
            else "the Trainer stopped (control.should_training_stop)"
        )
        restarting = client.restarting
        client.done(reason)
        client.close()
        for h in self._hooks:
            h.remove()
        self._hooks, self.client, self._model = [], None, None
        if restarting and self.env is not None and self.env.tune:
            # a switch: gptop starts the script again from the checkpoint just saved; what it does after
            # train() belongs to the run's end (module docstring)
            raise SystemExit(0)

    # ------------------------------------------------------------------ a step
    def _next_step(self, state: TrainerState) -> None:
        self._mark = time.perf_counter()
        assert self.client is not None
        self.client.begin_step(state.global_step + 1)
        self.client.enter("data")

    def _restart(self) -> None:
        """Logging, evaluation or a save ran since the step's boundary: the data wait begins now."""
        self._mark = time.perf_counter()
        if self.client is not None:
            self.client.restart_step()
            self.client.enter("data")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.client is not None:
            self.client.leave("data")  # the Trainer fetched the step's batches before calling this

    def _forward_begins(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        client = self.client
        if client is None or not client.in_step or not module.training:
            return
        ids = token_ids(args, kwargs)
        if not client.said_hello:
            seq_len = int(ids.shape[-1]) if ids is not None and ids.dim() >= 2 else None
            self._hello(client, module, seq_len)
        if ids is not None:
            client.add_tokens(ids.numel())
        client.leave("data")
        client.leave("backward")  # the previous micro-batch's
        client.enter("forward")

    def _forward_ends(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        client = self.client
        if client is None or not client.in_step or not client.is_open("forward"):
            return
        client.leave("forward")
        client.enter("backward")

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.client is not None:
            self.client.leave("backward")
            self.client.enter("optimizer")

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.client is not None:
            self.client.leave("optimizer")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        client = self.client
        if client is None:
            return
        if not client.said_hello:
            self._hello(client, self._model)
        client.end_step()
        client.poll()
        self._own_save = bool(control.should_save)  # set by the Trainer's own flow (DefaultFlowCallback), first
        if client.is_log_step():
            self._flush_due = True
            control.should_log = True  # the Trainer reads its loss back now; on_log reports it
        if client.should_checkpoint or client.should_stop:
            control.should_save = True
        if client.should_stop:
            control.should_training_stop = True
        self._next_step(state)

    # ------------------------------------------------------------------ what runs between steps
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        client = self.client
        if client is None:
            return
        logs = logs or {}
        if "loss" in logs:
            client.log(loss=logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))
            if self._flush_due:
                self._flush_due = False
                client.flush()
        self._restart()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._restart()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_save:  # save_strategy="epoch": the Trainer saves at this step on its own
            self._own_save = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        client = self.client
        if client is None:
            return
        assert args.output_dir is not None  # TrainingArguments.__post_init__ sets its default
        path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        if state.is_world_process_zero and self._model is not None and os.path.isdir(path):
            prints = weights_fingerprint(self._model)
            if prints is not None:
                atomic_write(os.path.join(path, WEIGHTS_FILE), json.dumps(prints))
        # a save the Trainer makes on its own too is the script's ("interval"): gptop keeps it where it is; one
        # made only for gptop's stop is gptop's to move (gptop.held_checkpoints)
        own = self._own_save or (
            args.save_strategy == "best" and getattr(state, "best_global_step", None) == state.global_step
        )
        self._own_save = False
        client.checkpointed(
            path,
            seconds=time.perf_counter() - self._mark,
            step=state.global_step,
            reason="interval" if own else None,
        )
        self._restart()
