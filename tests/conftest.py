import os
import sys
from pathlib import Path

import pytest

# One small, shared cache for the whole test session: the builtin tokenizer is trained
# once on a ~300 KB slice of the stdlib instead of the full default corpus.
_CACHE = Path(os.environ.get("GPTOP_TEST_CACHE", Path(__file__).resolve().parent.parent / ".pytest-gptop-cache"))
os.environ.setdefault("GPTOP_CACHE", str(_CACHE))
os.environ.setdefault("GPTOP_BUILTIN_BYTES", "300000")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
# threads fight each other (measured 3-8x slower); trainer subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parent.parent

# Tiny runs for tests: small sequences and batches so a step takes milliseconds.
TINY = ["--size", "tiny", "--seq-len", "64", "--global-batch", "4", "--warmup-steps", "2", "--eval-every", "0",
        "--log-every", "1", "--checkpoint-every", "0", "--device", "cpu"]


@pytest.fixture
def tiny_args():
    return list(TINY)


def trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]
