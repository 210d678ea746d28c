"""Expert parallelism for a frozen Nemotron-H target: its routed experts sharded over a group of ranks.

``trainer.strategy.ep_size = n`` splits the world into groups of ``n`` consecutive ranks; inside a
group each rank keeps ``1/n`` of every MoE block's routed experts (the router, the shared expert
and every other block stay whole on every rank), so a target whose experts do not fit one GPU
still supplies taps. The draft is unaffected: it trains under FSDP2 / DDP over all ranks, each
rank on its own data.

The sharding is nemo_automodel's: each HF ``NemotronHExperts`` is replaced by nemo_automodel's
``GroupedExperts`` holding the same weights (its native layout: ``gate_and_up_projs [E, H, I]``,
``down_projs [E, I, H]``), distributed with its ``ExpertParallel`` style (``Shard(0)`` over the
expert dimension). Its forward gathers every rank's tokens (their counts may differ), applies
this rank's experts and all-reduces the outputs: the torch dispatcher, which runs on gloo as on
NCCL (DeepEP and the other dispatchers are CUDA-only and not used here).

Every forward of the target is therefore a collective over its expert group: the ranks of a
group must run the same number of LLM forwards. Training and teacher-forced validation do (one
target forward per micro-batch on every rank, a placeholder where a rank has no anchor); phases
that decode a rank's own records (serving validation, serving-aware anchors) run inside
:meth:`ForwardLockstep.uneven` on the target, which keeps the ranks in step: before each forward a
rank says whether it is still decoding (one tiny all-reduce), and a rank that has finished runs a
one-token forward as long as another rank of its group still decodes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


MOE_BLOCK = "moe"
"""HF's ``layers_block_type`` entry of a Nemotron-H MoE block (``E`` in the hybrid pattern)."""


def expert_parallel_problem(ep_size: int, world_size: int, llm_config) -> str | None:
    """Why ``trainer.strategy.ep_size`` cannot shard this target on ``world_size`` ranks, or ``None``.

    ``llm_config`` is the target LLM's HF config (read before any weight loads)."""
    if ep_size == 1:
        return None
    key = f"trainer.strategy.ep_size={ep_size}"
    if ep_size < 1:
        return f"{key} must be >= 1"
    if world_size % ep_size:
        return f"{key} does not divide the {world_size} ranks of this launch; use a divisor of the world size"
    kinds = list(getattr(llm_config, "layers_block_type", None) or [])
    if MOE_BLOCK not in kinds:
        model_type = getattr(llm_config, "model_type", "?")
        return (
            f"{key}: the target ({model_type}) has no MoE blocks to shard; expert parallelism applies to Nemotron-H "
            "targets with MoE (E) blocks, set trainer.strategy.ep_size=1"
        )
    experts = int(llm_config.n_routed_experts)
    if experts % ep_size:
        return f"{key} does not divide the target's {experts} routed experts; use a divisor of {experts}"
    return None


def _grouped_experts_config(llm_config):
    """nemo_automodel's ``MoEConfig`` for a Nemotron-H MoE block's routed experts (non-gated ReLU², no bias:
    HF's ``NemotronHExperts`` has none whatever ``mlp_bias`` says); the router fields are unused by the experts
    and set as the model sets them."""
    from nemo_automodel.components.moe.config import MoEConfig

    return MoEConfig(
        n_routed_experts=llm_config.n_routed_experts,
        n_shared_experts=1,
        n_activated_experts=llm_config.num_experts_per_tok,
        n_expert_groups=llm_config.n_group,
        n_limited_groups=llm_config.topk_group,
        train_gate=False,
        gate_bias_update_factor=0.0,
        aux_loss_coeff=0.0,
        score_func="sigmoid",
        route_scale=llm_config.routed_scaling_factor,
        dim=llm_config.hidden_size,
        inter_dim=llm_config.intermediate_size,
        moe_inter_dim=llm_config.moe_intermediate_size,
        norm_topk_prob=llm_config.norm_topk_prob,
        expert_bias=False,
        expert_activation="relu2",
        moe_latent_size=getattr(llm_config, "moe_latent_size", None),
    )


class ShardedExperts(nn.Module):
    """HF Nemotron-H's experts call ``(hidden_states, top_k_index, top_k_weights)`` answered by nemo_automodel's
    ``GroupedExperts`` with this rank's share of the experts (module docstring)."""

    def __init__(self, hf_experts: nn.Module, llm_config, ep_mesh):
        super().__init__()
        from accelerate import init_empty_weights
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.moe.experts import GroupedExperts
        from nemo_automodel.components.moe.parallelizer import ExpertParallel
        from torch.distributed.tensor.parallel import parallelize_module

        backend = BackendConfig(linear="torch", rms_norm="torch", attn="sdpa", experts="torch", dispatcher="torch")
        up, down = hf_experts.up_proj, hf_experts.down_proj
        with init_empty_weights():  # no random expert weights: the target's own are assigned next
            grouped = GroupedExperts(_grouped_experts_config(llm_config), backend)
        grouped.gate_and_up_projs = nn.Parameter(up.detach().transpose(1, 2).contiguous(), requires_grad=False)
        grouped.down_projs = nn.Parameter(down.detach().transpose(1, 2).contiguous(), requires_grad=False)
        self.grouped = parallelize_module(grouped, ep_mesh, ExpertParallel())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        every_token = torch.ones(hidden_states.shape[0], dtype=torch.bool, device=hidden_states.device)
        return self.grouped(hidden_states, every_token, top_k_weights, top_k_index)


def shard_experts(causal_lm: nn.Module, ep_mesh) -> int:
    """Replace the routed experts of every MoE block of HF ``NemotronHForCausalLM`` ``causal_lm`` by their
    :class:`ShardedExperts` over ``ep_mesh``; the number of blocks sharded."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    config = causal_lm.config.get_text_config()
    blocks = [m for m in causal_lm.modules() if isinstance(m, NemotronHMoE)]
    for block in blocks:
        block.experts = ShardedExperts(block.experts, config, ep_mesh)
    return len(blocks)


def expert_parallel_mesh(ep_size: int, device_type: str):
    """The 1-D mesh of this rank's expert group: ranks ``[g·ep_size, (g+1)·ep_size)`` (the process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh

    groups = dist.get_world_size() // ep_size
    mesh = init_device_mesh(device_type, (groups, ep_size), mesh_dim_names=("expert_groups", "expert_parallel"))
    return mesh["expert_parallel"]


class ForwardLockstep:
    """Keeps the ranks of an expert group running the same number of LLM forwards where their work differs.

    Hooked on the target's decoder: inside :meth:`uneven` every forward is preceded by an all-reduce
    of "still working" over the group; when this rank's work is done, :meth:`uneven` runs one-token
    forwards for as long as another rank announces one, then all leave together. Outside
    :meth:`uneven` forwards are not announced (training runs one forward per micro-batch everywhere).
    """

    def __init__(self, decoder: nn.Module, group, hidden_size: int):
        self.decoder = decoder
        self.group = group
        self.hidden_size = hidden_size
        self.active = False
        self.idle_forwards = 0  # one-token forwards this rank ran to keep its group in step
        decoder.register_forward_pre_hook(self._announce)

    def _working_ranks(self, working: bool, device: torch.device) -> int:
        flag = torch.tensor([1 if working else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, group=self.group)
        return int(flag.item())

    def _announce(self, _module, _args):
        if self.active:
            self._working_ranks(True, self._device())

    def _device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    @contextmanager
    def uneven(self) -> Iterator[None]:
        """A phase in which ranks may run different numbers of forwards; on leaving it, wait in step for the
        group's other ranks (one-token forwards) until every rank has left."""
        self.active = True
        try:
            yield
        finally:  # a rank that fails here leaves its group waiting: the launcher's timeout ends the run
            self.active = False
        device = self._device()
        dtype = next(p for p in self.decoder.parameters() if p.is_floating_point()).dtype
        idle = torch.zeros(1, 1, self.hidden_size, dtype=dtype, device=device)
        with torch.no_grad():
            while self._working_ranks(False, device):
                self.decoder(inputs_embeds=idle, use_cache=False)
                self.idle_forwards += 1
