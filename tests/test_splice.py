"""Audio splicing (docs/target.md, Audio splicing) on real speech through the real SALM perception."""

from types import SimpleNamespace

import pytest
import torch
from conftest import pad_rows

from dflash_train.data.batch import SpeechBatch, audio_placements
from dflash_train.target import PlaceholderMismatchError, splice_audio_frames

MASK_ID = 330
BLOCK = 4


def _encode_prompt(target, text_before, text_after):
    tok = target.tokenizer
    tag = target.audio_locator_tag_id
    before = tok.text_to_ids(text_before)
    after = tok.text_to_ids(text_after)
    ids = before + [tag] + after
    loss = [False] * (len(before) + 1) + [True] * len(after)
    return ids, loss


def _batch(target, rows):
    return pad_rows(rows, target.pad_id)


def _speech(ids, lengths, loss, audios, audio_lens):
    """A one-audio-per-row SpeechBatch without host placements: the target reads them itself."""
    return SpeechBatch(ids, loss, lengths, audios, audio_lens, [1] * len(ids), [f"row{i}" for i in range(len(ids))])


def test_real_audio_expands_to_perception_frames_and_stays_aligned(tiny_target, speech_batch):
    audios, audio_lens = speech_batch
    rows = [
        _encode_prompt(tiny_target, "transcribe: ", " hello world"),
        _encode_prompt(tiny_target, "hi ", " the draft proposes tokens and the target checks them"),
        _encode_prompt(tiny_target, "", " a small speech model"),
    ]
    ids, loss, lengths = _batch(tiny_target, rows)
    out = tiny_target.splice_batch(_speech(ids, lengths, loss, audios, audio_lens), MASK_ID)

    with torch.no_grad():
        frames, frame_lens = tiny_target.salm.perception(input_signal=audios, input_signal_length=audio_lens)
    for i, (r_ids, r_loss) in enumerate(rows):
        n_frames = int(frame_lens[i])
        assert int(out.lengths[i]) == len(r_ids) - 1 + n_frames
        assert int(out.audio_mask[i].sum()) == n_frames
        place = r_ids.index(tiny_target.audio_locator_tag_id)
        # text before the placeholder, the frames, then the text after: token by token
        assert out.input_ids[i, :place].tolist() == r_ids[:place]
        assert out.input_ids[i, place : place + n_frames].tolist() == [MASK_ID] * n_frames
        assert out.input_ids[i, place + n_frames : out.lengths[i]].tolist() == r_ids[place + 1 :]
        assert out.loss_mask[i, : out.lengths[i]].tolist() == r_loss[:place] + [False] * n_frames + r_loss[place + 1 :]
        torch.testing.assert_close(out.inputs_embeds[i, place : place + n_frames], frames[i, :n_frames])
        torch.testing.assert_close(
            out.inputs_embeds[i, :place], tiny_target.embed_tokens(torch.tensor(r_ids[:place], dtype=torch.long))
        )
    assert not out.loss_mask[out.audio_mask].any()


def test_padding_never_enters_a_draft_context(tiny_target, speech_batch):
    """Rows of three lengths, spliced together and laid out as training lays them out: every valid anchor
    (supervised, a full block left in its row) has a context that is the row's own, position for position
    the row spliced alone; the padding sits after the last block."""
    from dflash_train.data.packing import document_layout
    from dflash_train.variants import DFLASH

    audios, audio_lens = speech_batch
    rows = [_encode_prompt(tiny_target, "a ", " b" * n) for n in (5, 9, 6)]
    ids, loss, lengths = _batch(tiny_target, rows)
    out = tiny_target.splice_batch(_speech(ids, lengths, loss, audios, audio_lens), MASK_ID)
    layout = document_layout(torch.where(out.attention_mask, 0, -1))  # DFlashDraftModule.prepare's layout
    width = out.input_ids.shape[1]
    for i, (r_ids, r_loss) in enumerate(rows):
        alone_ids, alone_loss, alone_len = _batch(tiny_target, [(r_ids, r_loss)])
        alone = tiny_target.splice_batch(_speech(alone_ids, alone_len, alone_loss, audios[i : i + 1],
                                                 audio_lens[i : i + 1]), MASK_ID)
        n = int(alone.lengths[0])
        # the variant's anchor rule (DFlash: a supervised position with BLOCK - 1 real tokens after it)
        valid = out.loss_mask[i] & (layout.doc_remaining[i] >= DFLASH.block_span(SimpleNamespace(block_size=BLOCK)))
        anchors = valid.nonzero().flatten().tolist()
        assert anchors and max(anchors) + BLOCK <= n, f"row {i}: a block reaches past the row's {n} positions"
        end = max(anchors) + BLOCK  # the last position any block of this row reads
        assert torch.equal(out.input_ids[i, :end], alone.input_ids[0, :end])
        assert torch.equal(out.loss_mask[i, :end], alone.loss_mask[0, :end])
        torch.testing.assert_close(out.inputs_embeds[i, :end], alone.inputs_embeds[0, :end])
        assert not out.loss_mask[i, n:].any() and (out.input_ids[i, n:] == tiny_target.pad_id).all()
    assert int(out.lengths.min()) < width, "the test needs rows of different lengths"


def test_matches_nemo_splice_up_to_padding_side(tiny_target, speech_batch):
    from nemo.collections.speechlm2.models.salm import replace_placeholders_and_build_targets

    audios, audio_lens = speech_batch
    rows = [_encode_prompt(tiny_target, "x ", " hello"), _encode_prompt(tiny_target, "yy ", " world and more")]
    ids, loss, lengths = _batch(tiny_target, rows)
    ours = tiny_target.splice_batch(_speech(ids, lengths, loss, audios[:2], audio_lens[:2]), MASK_ID)
    audio_embs = tiny_target.encode_audio(audios[:2], audio_lens[:2])
    for i in range(2):
        row = ids[i : i + 1, : int(lengths[i])]  # NeMo expects left padding; compare unpadded rows
        safe = torch.where(row == tiny_target.audio_locator_tag_id, 0, row)
        nemo_embs, _, nemo_mask = replace_placeholders_and_build_targets(
            input_ids=row,
            embeds=tiny_target.embed_tokens(safe),
            padding_id=tiny_target.pad_id,
            placeholder_id=tiny_target.audio_locator_tag_id,
            replacements=[audio_embs[i]],
        )
        n = int(ours.lengths[i])
        assert nemo_embs.shape[1] == n and bool(nemo_mask.all())
        torch.testing.assert_close(ours.inputs_embeds[i, :n], nemo_embs[0])


def test_placeholder_count_mismatch_names_the_sample():
    ids = torch.tensor([[5, 7, 7, 9]])
    with pytest.raises(PlaceholderMismatchError, match="sample 'cut-42' has 2 audio placeholder"):
        splice_audio_frames(
            input_ids=ids,
            row_lengths=[4],
            audio_positions=audio_placements(ids, torch.tensor([4]), 7)[1],
            loss_mask=torch.ones(1, 4, dtype=torch.bool),
            text_embeds=torch.zeros(1, 4, 8),
            audio_embeds=[torch.ones(3, 8)],
            audios_per_row=[1],
            mask_token_id=99,
            pad_id=0,
            sample_ids=["cut-42"],
        )


def test_two_audios_in_one_row_are_spliced_in_order():
    ids = torch.tensor([[5, 7, 6, 7, 9, 0]])
    out = splice_audio_frames(
        input_ids=ids,
        row_lengths=[5],
        audio_positions=audio_placements(ids, torch.tensor([5]), 7)[1],
        loss_mask=torch.tensor([[0, 0, 0, 0, 1, 0]], dtype=torch.bool),
        text_embeds=torch.zeros(1, 6, 2),
        audio_embeds=[torch.full((2, 2), 1.0), torch.full((3, 2), 2.0)],
        audios_per_row=[2],
        mask_token_id=99,
        pad_id=0,
    )
    assert out.input_ids[0].tolist() == [5, 99, 99, 6, 99, 99, 99, 9]
    assert out.loss_mask[0].tolist() == [False] * 7 + [True]
    assert out.inputs_embeds[0, :, 0].tolist() == [0, 1, 1, 0, 2, 2, 2, 0]


def test_packed_document_ids_follow_their_placeholders():
    ids = torch.tensor([[5, 7, 6, 8, 7, 9]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = splice_audio_frames(
        input_ids=ids,
        row_lengths=[6],
        audio_positions=audio_placements(ids, torch.tensor([6]), 7)[1],
        loss_mask=torch.zeros(1, 6, dtype=torch.bool),
        text_embeds=torch.zeros(1, 6, 2),
        audio_embeds=[torch.ones(2, 2), torch.ones(3, 2)],
        audios_per_row=[2],
        mask_token_id=99,
        pad_id=0,
        document_ids=docs,
    )
    assert out.input_ids[0].tolist() == [5, 99, 99, 6, 8, 99, 99, 99, 9]
    assert out.document_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
