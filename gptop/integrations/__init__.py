"""gptop inside your own training code: clients of the trainer's protocol that `gptop run -- CMD` listens to.

- `gptop.integrations.torch.Probe`: a plain PyTorch loop (one `probe.step(n)` call a step; hooks give the phases).
- `gptop.integrations.transformers.GptopCallback` (with `tuned_args`, `resume_checkpoint`): transformers.Trainer.
- `gptop.integrations.lightning.GptopCallback`: Lightning (`pip install 'gptop[lightning]'`).

They are imported only by the user's program, never by gptop itself (gptop stays torch-free; the submodules
import torch, transformers or Lightning). Outside gptop (no GPTOP_CHANNEL in the environment) each call is a
no-op, so they can stay in the code. docs/your-code.md shows the three.
"""

from __future__ import annotations

import os
import socket

from trainer.contract.client import CHANNEL_ENV, TUNE_ENV


def announce() -> None:
    """Under `gptop tune -- CMD`, tell gptop as soon as an integration is imported (at the top of a script,
    seconds after its start) that the program has a gptop client: one connection to the channel, closed at once.
    gptop then waits for the client's hello however long the program takes to build its model and data; a
    program that shows no client is refused (gptop.trial_processes.TrialProcesses.check_client). Nothing is
    sent, and nothing happens outside gptop tune."""
    channel = os.environ.get(CHANNEL_ENV, "")
    if os.environ.get(TUNE_ENV) != "1" or not channel.startswith("unix:"):
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(channel[len("unix:") :])
    except OSError:
        pass  # gptop is gone: the client says so when it connects


announce()
