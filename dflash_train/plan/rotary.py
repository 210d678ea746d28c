"""EAGLE-3's rotary table under fake tensors: its size given instead of read from the positions.

nemo_automodel's ``LlamaRotaryEmbedding`` (the EAGLE-3 draft's) sizes its cos/sin table on its non-fused path
from ``position_ids.max().item()``: a host sync on a GPU (one per training-time-test step; it grows the table
when a step's offset positions pass it) and a value fake tensors do not have. Inside
:func:`bounded_rotary_positions` each such table is sized for the widest row the step can pass, ``width +
ttt_steps`` positions (step *k* reads positions up to ``width - 1 + k``, ``k < ttt_steps``), which is the
size the real table reaches after the first step; cos and sin are gathered by the positions' values as
nemo_automodel's forward does, so the step's memory and cost are the real step's less the sync.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _gather_with_bounded_table(self, x: torch.Tensor, position_ids: torch.Tensor, *, qkv_format: str = "bshd",
                               cp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRotaryEmbedding.forward``'s non-fused path, the table sized ``_plan_extra_positions`` beyond the row."""
    self._ensure_cache(position_ids.shape[-1] + self._plan_extra_positions, x.device)
    return self._cos_cache[position_ids], self._sin_cache[position_ids]


@contextmanager
def bounded_rotary_positions(module: torch.nn.Module, extra_positions: int) -> Iterator[None]:
    """Every nemo_automodel ``LlamaRotaryEmbedding`` in ``module`` (none outside an EAGLE-3 draft) sizes its table
    for its input's width plus ``extra_positions`` while the block runs (module docstring); put back on exit."""
    from nemo_automodel.components.models.llama.rope_utils import LlamaRotaryEmbedding

    tables = [m for m in module.modules() if isinstance(m, LlamaRotaryEmbedding)]
    if any(m.rope_fusion for m in tables):
        raise NotImplementedError("the plan covers nemo_automodel's non-fused rotary path (the EAGLE-3 draft's)")
    for table in tables:
        table._plan_extra_positions = extra_positions
        table.forward = _gather_with_bounded_table.__get__(table)
    try:
        yield
    finally:
        for table in tables:
            del table.forward, table._plan_extra_positions
