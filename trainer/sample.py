"""`python -m trainer.sample RUN_DIR --prompt TEXT`: text from a run's checkpoint, or from an exported model.

Causal models (llama, deepseek, a fine-tuned causal model) generate with transformers'
`generate`: temperature 0 is greedy decoding; above 0 each token is drawn from
softmax(logits / T) over the whole vocabulary (no top-k or top-p), until the end-of-text
token or --max-new-tokens.

llada generates with the reverse process of LLaDA (Nie et al. 2025, "Large Language
Diffusion Models", Algorithm 5, low-confidence remasking). The completion of length L
starts fully masked after the prompt; at reverse step k of N (time t = 1 - (k-1)/N down
to s = 1 - k/N) the model predicts every masked position at once, and of those
predictions the ones it is most confident in (the probability of the predicted token)
are kept so that floor(L * k / N) completion tokens are unmasked after the step; the
rest are masked again. At temperature T > 0 the prediction of a position is drawn from
softmax(logits / T) (the reference code's Gumbel-max, the same distribution) and its
confidence is still its probability at temperature 1. Tokens never unmask into the mask
token or into the padded part of the vocabulary.

The prompt is preceded by the end-of-text token when the tokenizer adds no
beginning-of-text token: training data separates documents with it, so the prompt reads
as the start of a document (and an empty prompt is an unconditional sample).

--timeout bounds the whole process, from its start: generation stops at the deadline
and keeps what it has (`stopped: timeout`; llada fills the still-masked positions with
its last predictions). With --json the result is one `SampleResult` line on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from . import process_costs
from .contract import tools
from .contract.tools import SampleResult
from .export import EXIT_OK, tool_main
from .model_loading import LoadedModel, eos_id, load_for_inference, stderr_log

log = stderr_log("sample")


def process_start() -> float:
    """Wall-clock time this process started (the --timeout counts the import of torch too)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil or no /proc: start counting now
        return time.time()


# --- llada: the masked-diffusion reverse process ------------------------------------------------


@torch.no_grad()
def llada_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    length: int,
    steps: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    vocab: int | None = None,
    deadline: float | None = None,
) -> tuple[torch.Tensor, int]:
    """LLaDA's reverse process with low-confidence remasking (see the module docstring).

    `prompt` is [1, P] token ids; returns (the L completion ids, the reverse steps done). `vocab`
    bounds the ids that may be generated (the tokenizer's size; the model's rows beyond it are
    padding). `deadline` (time.time()) ends the process early: the positions still masked take the
    last step's predictions."""
    if not 1 <= steps <= length:
        raise ValueError(f"steps must be in [1, {length}], got {steps}")
    device = prompt.device
    P = prompt.shape[1]
    x = torch.cat([prompt, torch.full((1, length), mask_id, dtype=prompt.dtype, device=device)], dim=1)
    pred = None
    done = 0
    for k in range(1, steps + 1):
        if deadline is not None and done > 0 and time.time() >= deadline:
            break
        masked = x[0, P:] == mask_id
        logits = model(input_ids=x).logits[0, P:].float()  # [L, V]: every position at once
        if vocab is not None and vocab < logits.shape[-1]:
            logits[:, vocab:] = float("-inf")
        logits[:, mask_id] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if temperature > 0:
            pred = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
        else:
            pred = logits.argmax(dim=-1)
        confidence = probs.gather(-1, pred[:, None])[:, 0]
        confidence = confidence.masked_fill(~masked, float("-inf"))  # already unmasked: stays as it is
        unmasked_after = length * k // steps  # floor(L * (1 - s)), s = 1 - k/N
        n_new = unmasked_after - int((~masked).sum())
        if n_new > 0:
            keep = confidence.topk(n_new).indices  # the rest is remasked
            x[0, P + keep] = pred[keep]
        done = k
    completion = x[0, P:].clone()
    still = completion == mask_id
    if still.any() and pred is not None:
        completion[still] = pred[still]
    return completion, done


# --- causal: transformers' generate -------------------------------------------------------------


@torch.no_grad()
def causal_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos: int | None,
    pad: int | None,
    vocab: int | None,
    max_time: float | None,
) -> torch.Tensor:
    """New token ids after `prompt` ([1, P]) by `model.generate` (seed the global RNG first)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "use_cache": True,
        "do_sample": temperature > 0,
        "attention_mask": torch.ones_like(prompt),
    }
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)  # the full distribution
    if eos is not None:
        kwargs["eos_token_id"] = eos
    kwargs["pad_token_id"] = pad if pad is not None else eos
    rows = model.get_output_embeddings().weight.shape[0]
    if vocab is not None and vocab < rows:
        kwargs["suppress_tokens"] = list(range(vocab, rows))  # padded rows are no tokens
    if max_time is not None:
        kwargs["max_time"] = max(0.01, max_time)
    out = model.generate(prompt, **kwargs)
    return out[0, prompt.shape[1] :]


# --- the tool -----------------------------------------------------------------------------------


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's ids, after end-of-text when the tokenizer adds no beginning-of-text token."""
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    eos = eos_id(tokenizer)
    if tokenizer.bos_token_id is None and eos is not None:
        ids = [eos] + ids
    return ids


def sample(ns: argparse.Namespace, started: float | None = None) -> SampleResult:
    started = process_start() if started is None else started
    deadline = started + ns.timeout
    candidates = tools.check_sample(ns)
    loaded = load_for_inference(ns.path, candidates, step_given=ns.step is not None, device=ns.device, log=log)
    ready = time.time()
    if ready >= deadline:
        raise TimeoutError(
            f"--timeout: {ns.timeout:g} s passed while loading the model ({ready - started:.1f} s); raise --timeout"
        )
    return generate(loaded, ns, deadline=deadline, load_seconds=ready - started)


def generate(
    loaded: LoadedModel, ns: argparse.Namespace, *, deadline: float | None = None, load_seconds: float = 0.0
) -> SampleResult:
    """One sample from a loaded model with the options of `ns` (tools.add_sample_arguments)."""
    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    ids = encode_prompt(tok, ns.prompt)
    temperature = tools.sampling_temperature(ns.temperature)
    if temperature != ns.temperature:
        log(
            f"temperature {ns.temperature:g} is below {tools.GREEDY_BELOW:g}, where sampling is greedy decoding "
            "(the limit as T -> 0): decoding greedily"
        )
    context = loaded.cfg.data.seq_len if loaded.cfg else tok.model_max_length
    if len(ids) + ns.max_new_tokens > context:
        log(
            f"warning: {len(ids)} prompt + {ns.max_new_tokens} new tokens is longer than the {context} tokens "
            "the model was trained on"
        )
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    eos, vocab = eos_id(tok), len(tok)
    torch.manual_seed(ns.seed)
    t0 = time.time()
    steps = None
    if loaded.objective == "llada":
        steps = ns.diffusion_steps or ns.max_new_tokens
        new, stopped = _generate_llada(loaded, ns, prompt, steps, temperature, vocab, deadline)
    else:
        new, stopped = _generate_causal(loaded, ns, prompt, temperature, eos, vocab, deadline)
    seconds = time.time() - t0
    new = new.tolist()
    if eos is not None and eos in new:  # a document ends there: what follows is another one
        new = new[: new.index(eos)]
        if stopped == "max_new_tokens":
            stopped = "eos"
    completion = tok.decode(new, skip_special_tokens=True)
    return SampleResult(
        source=str(loaded.source),
        step=loaded.step,
        family=loaded.bundle.family,
        objective=loaded.objective,
        prompt=ns.prompt,
        completion=completion,
        new_tokens=len(new),
        stopped=stopped,
        temperature=float(ns.temperature),
        seed=int(ns.seed),
        seconds=round(seconds, 3),
        load_seconds=round(load_seconds, 3),
        diffusion_steps=steps,
    )


def _generate_llada(
    loaded: LoadedModel,
    ns: argparse.Namespace,
    prompt: torch.Tensor,
    steps: int,
    temperature: float,
    vocab: int,
    deadline: float | None,
) -> tuple[torch.Tensor, str]:
    """A llada model's tokens by reverse diffusion, and why it stopped."""
    log(
        f"{loaded.bundle.family}: {ns.max_new_tokens} tokens in {steps} reverse steps (low-confidence "
        f"remasking), temperature {temperature:g}"
    )
    gen = torch.Generator(device=prompt.device).manual_seed(ns.seed)
    new, done = llada_generate(
        loaded.model,
        prompt,
        mask_id=loaded.mask_id,
        length=ns.max_new_tokens,
        steps=steps,
        temperature=temperature,
        generator=gen,
        vocab=vocab,
        deadline=deadline,
    )
    return new, "timeout" if done < steps else "max_new_tokens"


def _generate_causal(
    loaded: LoadedModel,
    ns: argparse.Namespace,
    prompt: torch.Tensor,
    temperature: float,
    eos: int | None,
    vocab: int,
    deadline: float | None,
) -> tuple[torch.Tensor, str]:
    """A causal model's tokens by transformers' generate, and why it stopped."""
    if ns.diffusion_steps is not None:
        log("note: --diffusion-steps applies to llada models only; ignored")
    log(
        f"{loaded.bundle.family}: up to {ns.max_new_tokens} tokens with transformers' generate, "
        f"{'greedy' if temperature == 0 else f'temperature {temperature:g}'}"
    )
    new = causal_generate(
        loaded.model,
        prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=temperature,
        eos=eos,
        pad=loaded.tokenizer.pad_token_id,
        vocab=vocab,
        max_time=None if deadline is None else deadline - time.time(),
    )
    ended = eos is not None and eos in new.tolist()
    return new, "eos" if ended else "max_new_tokens" if len(new) >= ns.max_new_tokens else "timeout"


def main(argv: list[str] | None = None) -> int:
    started = process_start()
    parser = argparse.ArgumentParser(
        prog="python -m trainer.sample", description="Generate text from a run's checkpoint or an exported model."
    )
    tools.add_sample_arguments(parser)
    ns = parser.parse_args(argv)

    def work() -> int:
        result = sample(ns, started)
        if ns.json:
            print(result.to_json(), flush=True)
        else:
            print(result.text, flush=True)
            where = f"step {result.step}" if result.step is not None else result.source
            rate = result.new_tokens / result.seconds if result.seconds > 0 else 0.0
            log(
                f"{result.new_tokens} tokens from {where} in {result.seconds:.2f} s ({rate:.0f} tokens/s), "
                f"stopped at {result.stopped}"
            )
        return EXIT_OK

    return tool_main("sample", work)


if __name__ == "__main__":
    sys.exit(process_costs.set_exit_code(main()))  # then no interpreter teardown
