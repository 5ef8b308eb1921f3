"""gptop inside your own training code: clients of the trainer's protocol that `gptop run -- CMD` listens to.

- `gptop.integrations.torch.Probe`: a plain PyTorch loop (one `probe.step(n)` call a step; hooks give the phases).
- `gptop.integrations.transformers.GptopCallback` (with `tuned_args`, `resume_checkpoint`): transformers.Trainer.
- `gptop.integrations.lightning.GptopCallback`: Lightning (`pip install 'gptop[lightning]'`).

They are imported only by the user's program, never by gptop itself (gptop stays torch-free; the submodules
import torch, transformers or Lightning). Outside gptop (no GPTOP_CHANNEL in the environment) each call is a
no-op, so they can stay in the code. docs/your-code.md shows the three.
"""
