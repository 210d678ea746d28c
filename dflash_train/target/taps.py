"""Hidden-state taps on a decoder's blocks (docs/target.md, Taps).

Feature *i* is the residual stream leaving decoder block *i*, before the final norm,
captured with forward hooks (HF's ``hidden_states`` tuple puts the post-norm tensor in
its last slot, so it cannot be used for the last block). Hooks live only for one forward
and are removed even when the forward raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from dflash_train.data.packing import document_layout
from dflash_train.errors import ConfigError
from dflash_train.target.base import TapOutput


class _StopForward(Exception):
    """Raised by the last tap's hook when later blocks are not needed."""


class TapRecorder:
    """Collects the outputs of chosen decoder blocks during one forward pass."""

    def __init__(self, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}

    def features(self) -> torch.Tensor | None:
        """Tapped states concatenated in ``layer_ids`` order: ``[B, S, len(layer_ids) * H]`` (``None``: no taps)."""
        if not self.layer_ids:
            return None
        missing = [i for i in self.layer_ids if i not in self.outputs]
        if missing:
            raise RuntimeError(f"decoder blocks {missing} did not run; the forward stopped before them")
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)


@contextmanager
def record_taps(
    layers: nn.ModuleList, layer_ids: Sequence[int], stop_after_last: bool = False
) -> Iterator[TapRecorder]:
    """Hook ``layers[i]`` for every tapped id for the duration of the ``with`` block.

    With ``stop_after_last`` the forward is cut short after the deepest tapped block; the
    caller runs the forward through :func:`run_until_taps_done` so that the cut is not
    mistaken for an error.
    """
    recorder = TapRecorder(layer_ids)
    last = max(layer_ids, default=None)
    handles = []

    def make_hook(index: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            recorder.outputs[index] = hidden
            if stop_after_last and index == last:
                raise _StopForward

        return hook

    try:
        for index in set(layer_ids):
            handles.append(layers[index].register_forward_hook(make_hook(index)))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


def run_until_taps_done(forward, *args, **kwargs):
    """Call ``forward``; a cut-short forward (all taps captured) returns ``None`` instead of raising."""
    try:
        return forward(*args, **kwargs)
    except _StopForward:
        return None


def derive_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default taps: ``num_draft_layers`` distinct blocks spread evenly over the target's depth.

    Follows the DFlash recipe (first tap at block 1, last at ``L - 3``) for deep targets and
    widens the range for shallow ones so ids never repeat (nemo_automodel's helper can
    return ``[1, 1]`` for a 4-block target with a 2-layer draft).
    """
    if num_target_layers < 1:
        raise ConfigError(f"the target has {num_target_layers} decoder blocks; cannot derive taps")
    count = min(num_draft_layers, num_target_layers)
    start, end = 1, num_target_layers - 3
    if end - start + 1 < count:
        start, end = 0, num_target_layers - 1
    if count == 1:
        return [(start + end) // 2]
    span = end - start
    return [start + round(i * span / (count - 1)) for i in range(count)]


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask: causal, within the same document, never onto padding."""
    width = document_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    valid = (document_ids >= 0)[:, None, :]
    mask = causal & same_doc & valid
    # A padding query row would be all-False (NaN in softmax): let it see itself.
    mask |= torch.eye(width, dtype=torch.bool, device=document_ids.device)
    return mask[:, None]


@torch.no_grad()
def tap_decoder(
    decoder: nn.Module,
    layers: nn.ModuleList,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: Sequence[int],
    return_last_hidden: bool = False,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> TapOutput:
    """Run an HF decoder stack and return the outputs of blocks ``layer_ids`` (pre-final-norm).

    Without ``return_last_hidden`` the forward stops after the deepest tapped block. Packed
    rows pass ``document_ids`` (``-1`` on padding) and per-document ``position_ids``:
    attention is then causal within each document only.
    """
    if document_ids is not None:
        attention_mask = document_attention_mask(document_ids)
    with record_taps(layers, layer_ids, stop_after_last=not return_last_hidden) as taps:
        out = run_until_taps_done(
            decoder,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            return_dict=True,
        )
        features = taps.features()
    return TapOutput(features, out.last_hidden_state if return_last_hidden else None)


def tap_documents_apart(
    decoder: nn.Module,
    layers: nn.ModuleList,
    inputs_embeds: torch.Tensor,
    document_ids: torch.Tensor,
    layer_ids: Sequence[int],
    return_last_hidden: bool = False,
) -> TapOutput:
    """:func:`tap_decoder` on packed rows, every document run in a right-padded row of its own.

    Exact for blocks that carry state along the sequence (Mamba-2): each document starts from a
    zero state, as it would alone, and right padding cannot reach earlier positions of a causal
    model. The outputs are scattered back to the packed positions (zeros on padding).
    """
    rows, columns = (document_ids >= 0).nonzero(as_tuple=True)
    offsets = document_ids.max() + 1
    documents, which = torch.unique(rows * offsets + document_ids[rows, columns], return_inverse=True)
    within = document_layout(document_ids).position_ids[rows, columns]
    width = int(within.max()) + 1 if len(within) else 1
    alone = inputs_embeds.new_zeros(len(documents), width, inputs_embeds.shape[-1])
    alone[which, within] = inputs_embeds[rows, columns]
    mask = torch.zeros(len(documents), width, dtype=torch.long, device=inputs_embeds.device)
    mask[which, within] = 1
    out = tap_decoder(decoder, layers, alone, mask, layer_ids, return_last_hidden=return_last_hidden)

    def packed(unpacked: torch.Tensor | None) -> torch.Tensor | None:
        if unpacked is None:
            return None
        result = unpacked.new_zeros(*document_ids.shape, unpacked.shape[-1])
        result[rows, columns] = unpacked[which, within]
        return result

    return TapOutput(packed(out.features), packed(out.last_hidden))
