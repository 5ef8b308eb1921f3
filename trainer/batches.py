"""Deterministic batches from a run's tokens (trainer.data holds them).

The sequences of optimizer step `b` are a pure function of (seed, b): a counter-based hash, stable across
numpy versions. Micro-batch `k` of size `m` is a slice of that fixed list, and rank `r` of `W` takes its
contiguous share, so changing the micro-batch, the number of ranks' accumulation, or resuming from a
checkpoint never changes the data of a step. Validation batches are fixed windows of the validation split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .contract.config import ConfigError

if TYPE_CHECKING:
    from .data import TokenData

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TRAIN_STREAM, _VAL_STREAM = 0x7472, 0x76616C


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-mixed 64-bit hash, defined here so batches never depend on numpy's RNG."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _counter_hash(seed: int, stream: int, index: int, count: int) -> np.ndarray:
    """`count` pseudo-random uint64 values that depend only on (seed, stream, index)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed % (1 << 64)], dtype=np.uint64) ^ np.uint64(stream))
        key = _mix(key ^ np.uint64(index % (1 << 64)))
        return _mix(key + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)


def _gather(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class BatchSampler:
    """The sequences of each optimizer step, as a pure function of (seed, batch_index).

    Step `b` has a fixed list of `global_batch` start offsets. Rank `r` of `world_size` takes the
    contiguous share [r*G/W, (r+1)*G/W) of it, and micro-batch `k` of size `m` is the slice
    [k*m, (k+1)*m) of the rank's share. So the micro-batch size never changes what a step learns,
    and a resumed run sees exactly the batches the uninterrupted run would have.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if global_batch < 1 or global_batch % world_size:
            raise ConfigError(
                "--global-batch",
                f"{global_batch} sequences cannot be split evenly over "
                f"{world_size} ranks; use a multiple of {world_size}",
            )
        self.n_starts = len(tokens) - seq_len  # offset o needs tokens[o : o + seq_len + 1]
        if seq_len < 1 or self.n_starts < 1:
            raise ConfigError("--seq-len", f"{seq_len} needs more than {len(tokens):,} tokens per sequence")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.local_batch = global_batch // world_size
        self._last: tuple[int, np.ndarray] | None = None

    def offsets(self, batch_index: int) -> np.ndarray:
        """Start offsets of all `global_batch` sequences of step `batch_index` (every rank's)."""
        h = _counter_hash(self.seed, _TRAIN_STREAM, batch_index, self.global_batch)
        return (h % np.uint64(self.n_starts)).astype(np.int64)

    def local_offsets(self, batch_index: int) -> np.ndarray:
        last = self._last  # one-entry cache: the micro-batches of a step share it
        if last is None or last[0] != batch_index:
            offs = self.offsets(batch_index)[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]
            last = self._last = (batch_index, offs)
        return last[1]

    def accumulation_steps(self, micro_batch: int) -> int:
        """Micro-batches per optimizer step on this rank; the micro-batch must divide the rank's share."""
        m, G, W = micro_batch, self.global_batch, self.world_size
        if m < 1 or self.local_batch % m:
            raise ConfigError(
                "--micro-batch",
                f"--global-batch {G} over {W} rank{'s' if W > 1 else ''} is "
                f"{self.local_batch} sequences per rank, not divisible by --micro-batch {m}; "
                f"--global-batch must be a multiple of {W} x {m} = {W * m}, or pick a micro-batch "
                f"dividing {self.local_batch}",
            )
        return self.local_batch // m

    def micro_batch(self, batch_index: int, micro_index: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors [micro_batch, seq_len] of this rank; y is x shifted by one token."""
        accum = self.accumulation_steps(micro_batch)
        if not 0 <= micro_index < accum:
            raise IndexError(f"micro_index {micro_index} not in [0, {accum})")
        offs = self.local_offsets(batch_index)[micro_index * micro_batch : (micro_index + 1) * micro_batch]
        return _gather(self.tokens, offs, self.seq_len)


def val_batches(
    data: TokenData, seq_len: int, micro_batch: int, n: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of `n` validation micro-batches, so every evaluation of a run measures the same text.

    Sequences are non-overlapping windows of the validation split chosen by (seed); if the split holds
    fewer than n * micro_batch windows they repeat. Empty when the split is shorter than one sequence.
    """
    val = data.val
    windows = (len(val) - 1) // seq_len if len(val) > seq_len else 0
    if windows < 1 or n < 1 or micro_batch < 1:
        return []
    order = np.argsort(_counter_hash(seed, _VAL_STREAM, 0, windows), kind="stable")
    offsets = order[np.arange(n * micro_batch) % windows].astype(np.int64) * seq_len
    return [_gather(val, offsets[i * micro_batch : (i + 1) * micro_batch], seq_len) for i in range(n)]
