"""Expert parallelism under fake tensors: the routed experts' token dispatch at a fixed, balanced shape.

A Nemotron-H target sharded with ``trainer.strategy.ep_size`` runs nemo_automodel's ``GroupedExperts``
with the torch dispatcher (:mod:`dflash_train.target.expert_parallel`). Two of its steps read data that
fake tensors do not have: the expert group's token counts (an all-gather, then ``.item()`` per rank) and
each expert's tokens (``torch.where`` over the routing, a data-dependent count). Inside
:func:`balanced_expert_routing` both are given instead, as a plan can know them:

* every rank of the planned world runs the same worst batch, so the group's token counts are equal and
  the gather is one all-gather per tensor of ``ep_size × tokens`` rows (activations, routing weights,
  expert ids, token mask), charged as the all-gathers the real dispatch runs;
* routing is balanced: each of the rank's ``E / ep_size`` experts takes ``⌈N·k / E⌉`` of the ``N``
  gathered tokens (``k`` experts per token), so a rank's expert FLOPs equal ``N/ep_size · k`` token-expert
  products, the mean of any routing. A skewed router makes the busiest rank slower and its transient
  expert buffers larger than planned; the weights, the gathered activations and the output all-reduce
  (``ep_size × tokens × hidden`` in FP32) do not depend on the routing.

The rest of the forward (the weights' cast, the output all-reduce, the narrowing to this rank's tokens) is
nemo_automodel's own. The target is frozen and runs without gradients, so the dispatch's backward is
never planned.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist


def _gather_equal_counts(x, token_mask, weights, indices, *, ep_group, ep_size):
    """``GroupedExperts._gather_ep_inputs`` when every rank of the group holds the same number of tokens."""

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=ep_group)
        return torch.cat(parts, dim=0)

    tokens = x.size(0)
    return gather(x), gather(weights.float()), gather(indices), gather(token_mask), [tokens] * ep_size


def _balanced_expert_loop(self, x, weights, indices, token_mask, gate_and_up_projs, down_projs, gate_up_proj_bias,
                          down_proj_bias, n_local_experts, experts_start_idx, experts_end_idx):
    """``GroupedExperts._forward_loop`` with each local expert taking its balanced share of the tokens
    (module docstring): gather, up projection, weighted activation, down projection, scatter-add in FP32."""
    if self.config.apply_router_weight_after_down or gate_up_proj_bias is not None or down_proj_bias is not None:
        raise NotImplementedError("the plan's balanced routing covers experts without biases that weight before "
                                  "the down projection (a Nemotron-H target's)")
    tokens, per_token = x.shape[0], weights.shape[1]
    share = max(1, min(tokens * per_token, -(-tokens * per_token // self.n_routed_experts)))
    # the activation is compiled for the GPU (one fused kernel); a plan runs its eager definition
    activation = getattr(self.expert_activation_grouped, "_torchdynamo_orig_callable", self.expert_activation_grouped)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for local in range(n_local_experts):
        idx = torch.arange(share, device=x.device) % tokens
        rows = x.index_select(0, idx)
        routing_weight = weights.index_select(0, idx)[:, :1]
        activated = activation(rows @ gate_and_up_projs[local], routing_weight)
        y.index_add_(0, idx, (activated @ down_projs[local]).float())
    return y


@contextmanager
def balanced_expert_routing() -> Iterator[None]:
    """nemo_automodel's ``GroupedExperts`` dispatches at the balanced, fixed shape of the module docstring
    while the block runs; put back on exit."""
    from nemo_automodel.components.moe.experts import GroupedExperts

    saved = GroupedExperts.__dict__["_gather_ep_inputs"], GroupedExperts.__dict__["_forward_loop"]
    GroupedExperts._gather_ep_inputs = staticmethod(_gather_equal_counts)
    GroupedExperts._forward_loop = _balanced_expert_loop
    try:
        yield
    finally:
        GroupedExperts._gather_ep_inputs, GroupedExperts._forward_loop = saved
