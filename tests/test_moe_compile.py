"""The MoE balancer's hooks under torch.compile: traced without graph breaks, no double counting.

aot_eager runs dynamo and AOTAutograd (which partitions activation-checkpoint
recomputation into the backward graph) without inductor's codegen, so it checks
the hook semantics in seconds; inductor itself was checked by hand (same counts).
"""

from __future__ import annotations

import pytest
import torch

from trainer import moe, objectives
from trainer.contract.config import ModelConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.models import build_model

# inductor may start compile workers
pytestmark = [pytest.mark.compile, pytest.mark.process, pytest.mark.usefixtures("one_thread")]

VOCAB, SEQ = 500, 32


def build(family: str, *, ac: bool = False):
    return build_model(
        ModelConfig(model=family, size="tiny"),
        vocab_size=VOCAB,
        seq_len=SEQ,
        toggles=Toggles(activation_checkpointing=ac),
        dev=DeviceInfo(type="cpu"),
    )


def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (b, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def test_balancer_hooks_trace_without_graph_breaks():
    b = build("deepseek")
    moe.MoEBalancer(b.model)
    b.model.train()
    x, _ = batch(2)
    explained = torch._dynamo.explain(lambda t: b.model(input_ids=t).logits)(x)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("ac", [False, True])
def test_balancer_counts_once_under_compile(ac):
    torch._dynamo.reset()
    x, y = batch(2)
    b = build("deepseek", ac=ac)
    bal = moe.MoEBalancer(b.model)
    b.model.train()
    compiled = torch.compile(b.model, backend="aot_eager")
    for _ in range(2):
        objectives.loss_fn("causal", compiled, x, y).backward()
    k = b.hf_config.num_experts_per_tok
    assert all(int(c.sum()) == 2 * x.numel() * k for c in bal._counts)
