"""Taps (docs/target.md, Taps), checked against the real SALM LLM's own hidden states."""

import pytest
import torch

from dflash_train.errors import ConfigError
from dflash_train.target import derive_target_layer_ids, record_taps


def _inputs(target, seed=0, batch=2, seq=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, seq), generator=gen)
    return target.embed_tokens(ids)


def test_taps_equal_hf_hidden_states_for_non_final_blocks(tiny_target):
    embeds = _inputs(tiny_target)
    layer_ids = list(range(tiny_target.num_layers))
    taps = tiny_target.forward_taps(embeds, None, layer_ids).features
    with torch.no_grad():
        hf = tiny_target.decoder(inputs_embeds=embeds, output_hidden_states=True, return_dict=True).hidden_states
    hidden = tiny_target.hidden_size
    assert taps.shape == (2, 12, len(layer_ids) * hidden)
    for slot, layer in enumerate(layer_ids[:-1]):
        diff = (taps[..., slot * hidden : (slot + 1) * hidden] - hf[layer + 1]).abs().max().item()
        assert diff <= 1e-6, f"tap {layer} differs from hidden_states[{layer + 1}] by {diff}"


def test_final_block_tap_is_pre_norm(tiny_target):
    embeds = _inputs(tiny_target, seed=1)
    last = tiny_target.num_layers - 1
    out = tiny_target.forward_taps(embeds, None, [last], return_last_hidden=True)
    with torch.no_grad():
        hf = tiny_target.decoder(inputs_embeds=embeds, output_hidden_states=True, return_dict=True).hidden_states
    assert (out.features - hf[-1]).abs().max().item() > 1e-3, "final tap must not equal HF's post-norm entry"
    normed = tiny_target.decoder.norm(out.features)
    assert torch.allclose(normed, hf[-1], atol=1e-6)
    assert torch.allclose(out.last_hidden, hf[-1], atol=1e-6)


def test_features_concatenate_in_list_order_and_early_stop_matches_full_forward(tiny_target):
    embeds = _inputs(tiny_target, seed=2)
    hidden = tiny_target.hidden_size
    early = tiny_target.forward_taps(embeds, None, [3, 1]).features
    full = tiny_target.forward_taps(embeds, None, [3, 1], return_last_hidden=True).features
    one = tiny_target.forward_taps(embeds, None, [1]).features
    torch.testing.assert_close(early, full, rtol=0, atol=0)
    torch.testing.assert_close(early[..., hidden:], one, rtol=0, atol=0)


def test_hooks_removed_after_forward_and_after_exception(tiny_target):
    layers = tiny_target.decoder_layers

    def hook_count():
        return sum(len(layer._forward_hooks) for layer in layers)

    baseline = hook_count()  # transformers keeps its own output-capturing hooks on the blocks
    tiny_target.forward_taps(_inputs(tiny_target), None, [0, 2])
    assert hook_count() == baseline
    with pytest.raises(RuntimeError, match="boom"):
        with record_taps(layers, [0, 2]):
            assert hook_count() == baseline + 2
            raise RuntimeError("boom")
    assert hook_count() == baseline


def test_padding_rows_do_not_change_valid_positions(tiny_target):
    """Left padding (right padding behind causal attention would hide a dropped mask): the valid positions
    must not see the pad embeddings (random, as garbage in a batch would be)."""
    embeds = _inputs(tiny_target, seed=3, batch=1, seq=10)
    padded = torch.cat([_inputs(tiny_target, seed=9, batch=1, seq=4), embeds], dim=1)
    mask = torch.tensor([[False] * 4 + [True] * 10])
    alone = tiny_target.forward_taps(embeds, None, [0, 4]).features
    with_pad = tiny_target.forward_taps(padded, mask, [0, 4]).features[:, 4:]
    torch.testing.assert_close(alone, with_pad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "target_layers, draft_layers, expected",
    [(36, 5, [1, 9, 17, 25, 33]), (4, 2, [0, 3]), (6, 6, [0, 1, 2, 3, 4, 5]), (28, 1, [13]), (3, 8, [0, 1, 2])],
)
def test_derived_taps_are_distinct_and_in_range(target_layers, draft_layers, expected):
    ids = derive_target_layer_ids(target_layers, draft_layers)
    assert ids == expected
    assert len(set(ids)) == len(ids) and all(0 <= i < target_layers for i in ids)


def test_derive_rejects_empty_target():
    with pytest.raises(ConfigError, match="0 decoder blocks"):
        derive_target_layer_ids(0, 2)


def test_packed_documents_match_separate_forwards(tiny_target):
    from dflash_train.data.packing import document_layout

    first, second = _inputs(tiny_target, seed=4, batch=1, seq=7), _inputs(tiny_target, seed=5, batch=1, seq=5)
    packed = torch.cat([first, second, torch.zeros(1, 2, first.shape[-1])], dim=1)
    docs = torch.tensor([[0] * 7 + [1] * 5 + [-1] * 2])
    layout = document_layout(docs)
    out = tiny_target.forward_taps(packed, None, [0, 5], position_ids=layout.position_ids, document_ids=docs).features
    alone_first = tiny_target.forward_taps(first, None, [0, 5]).features
    alone_second = tiny_target.forward_taps(second, None, [0, 5]).features
    torch.testing.assert_close(out[:, :7], alone_first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 7:12], alone_second, rtol=1e-5, atol=1e-5)
