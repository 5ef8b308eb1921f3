"""The data and model the examples share: a synthetic language held in memory and a tiny Llama.

Each token follows from the one before by a fixed rule (next = (3 * token + 7) % VOCAB), with one token in
ten random, so a model can learn it and its loss falls within a few dozen steps. The model is transformers'
LlamaForCausalLM built from a config (random initialization): nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256


def sequences(n: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.empty(n, seq_len, dtype=torch.long)
    x[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
    for t in range(1, seq_len):
        x[:, t] = (3 * x[:, t - 1] + 7) % VOCAB
    noise = torch.rand(n, seq_len, generator=generator) < 0.1
    x[noise] = torch.randint(VOCAB, (int(noise.sum()),), generator=generator)
    return x


class SyntheticText(Dataset):
    """`size` sequences of the synthetic language, as transformers' causal LMs take them."""

    def __init__(self, size: int, seq_len: int, seed: int = 0):
        self.x = sequences(size, seq_len, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_llama(seq_len: int) -> LlamaForCausalLM:
    """A 115k-parameter Llama: 2 layers of width 64."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq_len,
        )
    )
