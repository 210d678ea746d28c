"""FLOPs, memory traffic and collective bytes of the step by phase, and the roofline bound on a GPU.

Every operator the step runs is costed as it runs (on fake or real tensors alike): its FLOPs by
torch's own formulas (``torch.utils.flop_counter``; matmuls, convolutions, attention), the bytes a
FLOP-bearing operator must read and write (its operands and result, once each; elementwise operators
may be fused into them, so their traffic is not counted), and, for a collective, the bytes it moves
per rank. The roofline time of an operator is ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``; the
sum is a lower bound of the step's compute time on that GPU: a real kernel only reaches less than
peak, and the elementwise work left out only adds time.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry


@dataclass(frozen=True)
class GPU:
    """A GPU's figures the roofline uses: dense BF16 peak, HBM bandwidth, memory, and the per-GPU collective
    bandwidths inside a node (NVLink) and across nodes (one 400 Gb/s NIC per GPU)."""

    name: str
    bf16_flops: float  # dense, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    nvlink_bytes_per_s: float
    network_bytes_per_s: float = 50e9


GPUS = {
    "h100": GPU("H100 SXM 80 GB", 989e12, 3.35e12, 80 * 10**9, 450e9),
    "h200": GPU("H200 SXM 141 GB", 989e12, 4.8e12, 141 * 10**9, 450e9),
    "a100-80g": GPU("A100 SXM 80 GB", 312e12, 2.0e12, 80 * 10**9, 300e9),
    "b200": GPU("B200 192 GB", 2250e12, 8.0e12, 192 * 10**9, 900e9),
}
"""The GPUs ``--gpu`` names, with public spec-sheet figures (dense BF16, no sparsity)."""

COLLECTIVES = {"all_gather": ("allgather", "all_gather"), "reduce_scatter": ("reduce_scatter",),
               "all_reduce": ("allreduce", "all_reduce"), "all_to_all": ("alltoall", "all_to_all")}
"""Collective kinds, by the substrings of the c10d operator names that perform them."""


def _cpu_attention_flops(func, args) -> int | None:
    """FLOPs of CPU's fused SDPA kernels, which torch's table leaves out (it has the GPU ones): the forward's
    two matmuls ``4·B·H·Sq·Sk·D``, the backward's four ``8·B·H·Sq·Sk·D`` (the counts of torch's formulas for
    the GPU kernels); the plan and the check against real tensors run on CPU."""
    name = func.__name__
    if not name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return None
    backward = "backward" in name
    query, key = (args[1], args[2]) if backward else (args[0], args[1])
    batch, heads, s_q, dim = query.shape
    forward = 4 * batch * heads * s_q * key.shape[-2] * dim
    return 2 * forward if backward else forward


GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")
"""The grouped matmuls of MoE experts (torch's, and transformers' fallback op), which torch's table leaves out."""


def _grouped_mm_flops(func, args, out) -> int | None:
    """FLOPs of a grouped matmul (one matmul per expert over its slice of the rows): ``2·M·K·N`` summed over the
    groups, whatever the split (``[M, K] × [G, K, N]`` and ``[G, M, K] × [G, K, N]``: ``2·out.numel()·K``;
    ``[M, K] × [K, N]`` split along ``K`` into ``G`` outputs ``[G, M, N]``: ``2·M·K·N``)."""
    if func._overloadpacket.__name__ not in GROUPED_MM:
        return None
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


def _collective_kind(name: str) -> str | None:
    for kind, needles in COLLECTIVES.items():
        if any(needle in name for needle in needles):
            return kind
    return None


def _group_size(args) -> int:
    """Ranks in the group a c10d operator runs over: its process group argument (boxed as a script object by
    the dispatcher, or a functional collective's group name); the world when none is named."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).size()
            except RuntimeError:  # another boxed argument (the reduce op)
                continue
        if isinstance(arg, str):
            try:
                return _resolve_process_group(arg).size()
            except (ValueError, RuntimeError, KeyError):
                continue
    return dist.get_world_size()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class StepCost(TorchDispatchMode):
    """FLOPs, bytes moved and roofline seconds per phase, and collective bytes per kind, on ``gpu``."""

    def __init__(self, gpu: GPU) -> None:
        super().__init__()
        self.gpu = gpu
        self.phase = "target"
        self.flops: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.collective_bytes: dict[str, int] = defaultdict(int)
        self.group_bytes: dict[int, int] = defaultdict(int)  # the same bytes by the size of the group they ran over

    @contextmanager
    def charged_to(self, phase: str) -> Iterator[None]:
        """Operators of the block are charged to ``phase``."""
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        kind = _collective_kind(name) if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") else None
        if kind is not None:
            # the full buffer (an all-gather's output, a reduce-scatter's input): the largest argument or result,
            # a list of tensors (the list forms' per-rank parts) counted whole
            moved = max((_bytes(tree_flatten(part)[0]) for part in (*args, out)), default=0)
            self.collective_bytes[kind] += moved
            self.group_bytes[_group_size(args)] += moved
            return out
        flops = _cpu_attention_flops(func, args)
        if flops is None:
            flops = _grouped_mm_flops(func, args, out)
        formula = flop_registry.get(func._overloadpacket)
        if flops is None:
            flops = 0 if formula is None else formula(*args, **kwargs, out_val=out)
        # an operator with FLOPs (matmul, attention) reads its operands and writes its result at least once; an
        # elementwise one may be fused away, so only the former's bytes enter the bound
        moved = _bytes(tree_flatten((args, kwargs))[0]) + _bytes(tree_flatten(out)[0]) if flops else 0
        self.flops[self.phase] += flops
        self.bytes[self.phase] += moved
        self.seconds[self.phase] += max(flops / self.gpu.bf16_flops, moved / self.gpu.hbm_bytes_per_s)
        return out


def collective_seconds(group_bytes: dict[int, int], gpus_per_node: int, gpu: GPU) -> float:
    """Ring lower bound of the step's collectives, ``group_bytes`` by the size of the group each ran over: each
    rank sends ``(g−1)/g`` of each buffer, over NVLink when the group fits in one node (an expert-parallel group
    of consecutive ranks, a one-node world), over the network when it spans nodes (the slower link bounds the
    ring)."""
    seconds = 0.0
    for size, moved in group_bytes.items():
        if size > 1:
            bandwidth = gpu.nvlink_bytes_per_s if size <= gpus_per_node else gpu.network_bytes_per_s
            seconds += moved * (size - 1) / size / bandwidth
    return seconds
