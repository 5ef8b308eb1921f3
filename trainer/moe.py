"""DeepSeek-V3 auxiliary-loss-free expert load balancing.

DeepSeek-V3 (Sec. 2.1.2) adds a per-expert bias to the routing scores used for
top-k *selection* only (the gate weights still come from the raw scores). After
each step, the bias of an overloaded expert goes down by `update_rate` and the
bias of an underloaded one goes up:

    b_i += rate * sign(mean_load - load_i)

transformers' ``DeepseekV3TopkRouter`` already adds its buffer
``e_score_correction_bias`` to the scores before top-k, but nothing updates it.
`MoEBalancer` does: forward hooks on the routers count the tokens routed to
each expert during the step (on the device, ``scatter_add_``, no sync: unlike
``bincount`` on CUDA it needs no host read of the max, and it is deterministic
under ``torch.use_deterministic_algorithms``), and `update()` applies the rule
after the optimizer step.

What is counted: training forwards only. A forward under ``no_grad`` (eval) is
not counted, nor is the recomputed forward of activation checkpointing (it runs
inside backward, where ``torch._C._current_graph_task_id()`` is set — the same
signal torch.utils.checkpoint uses), so checkpointing does not double count.
Under torch.compile the hook is traced into the graph (no graph break): the
recompute check is skipped while compiling because compiled activation
checkpointing recomputes inside the compiled backward without calling Python
hooks again.

The bias is a persistent buffer, so it is saved in checkpoints with the model
and a resumed run continues with the same routing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that route tokens with a correctable bias (DeepseekV3TopkRouter and alikes)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
        and hasattr(m, "top_k")
        and hasattr(m, "num_experts")
    ]


def _counting_allowed() -> bool:
    if not torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():
        return True
    return torch._C._current_graph_task_id() == -1  # not inside backward (checkpoint recompute)


class MoEBalancer:
    """Counts expert load during a step and nudges the routers' biases toward uniform load.

    Call `update()` once after each optimizer step (on every rank); it adds no
    host-device sync. `load()` and `summary()` read the counts back and are
    meant for log steps.
    """

    def __init__(self, model: torch.nn.Module, update_rate: float = 1e-3):
        self.update_rate = float(update_rate)
        self.routers = find_routers(model)
        self.names = [name for name, _ in self.routers]
        self._counts: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None
        self._handles = []
        for i, (_, router) in enumerate(self.routers):
            bias = router.e_score_correction_bias
            self._counts.append(torch.zeros(router.num_experts, dtype=torch.int64, device=bias.device))
            self._handles.append(router.register_forward_hook(self._hook(i)))

    def __len__(self) -> int:
        return len(self.routers)

    def _hook(self, i: int):
        def hook(module: torch.nn.Module, args, output) -> None:
            if not _counting_allowed():
                return
            idx = output[2].reshape(-1)  # (router_logits, topk_weights, topk_indices)
            counts = self._counts[i]
            if counts.device != idx.device:  # the model moved after the balancer was made
                counts = self._counts[i] = counts.to(idx.device)
            counts.scatter_add_(0, idx.detach(), torch.ones_like(idx))

        return hook

    @torch.no_grad()
    def update(self) -> None:
        """Apply one bias update from this step's counts, then reset them."""
        if not self.routers:
            return
        loads = torch.stack([c.to(self._counts[0].device) for c in self._counts]).float()  # [layers, experts]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)  # every rank applies the same update
        mean = loads.mean(dim=-1, keepdim=True)
        delta = self.update_rate * torch.sign(mean - loads)
        for (_, router), d in zip(self.routers, delta):
            bias = router.e_score_correction_bias
            bias.add_(d.to(device=bias.device, dtype=bias.dtype))
        self._last = loads
        for c in self._counts:
            c.zero_()

    def reset(self) -> None:
        """Drop the counts gathered since the last update without using them (probe forwards, rollbacks)."""
        for c in self._counts:
            c.zero_()

    def load(self) -> list[list[float]]:
        """Per layer, the share of routed tokens each expert got in the last updated step (syncs).

        Empty before the first update (and for a dense model).
        """
        if self._last is None:
            return []
        total = self._last.sum(dim=-1, keepdim=True).clamp_min(1)
        return (self._last / total).cpu().tolist()

    def summary(self) -> dict[str, float] | None:
        """Load imbalance of the last step: the busiest expert's load over the mean (1.0 = uniform)."""
        if self._last is None or not self.routers:
            return None
        mean = self._last.mean(dim=-1).clamp_min(1e-9)
        ratio = self._last.max(dim=-1).values / mean  # per layer
        bias = torch.stack(
            [r.e_score_correction_bias.detach().float().abs().max().to(ratio.device) for _, r in self.routers]
        )
        return {
            "max_load_ratio": float(ratio.max()),
            "mean_load_ratio": float(ratio.mean()),
            "max_abs_bias": float(bias.max()),
        }

    def remove(self) -> None:
        """Detach the hooks (e.g. before rebuilding the model)."""
        for h in self._handles:
            h.remove()
        self._handles = []
