"""Batching on real speech: strict token budgets, packing layout, rank sharding, determinism, blending."""

from itertools import islice
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lhotse import CutSet

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.module import SpeechDataModule
from dflash_train.data.packing import document_layout
from dflash_train.data.sampling import TokenBudget

TAG = "<|audio|>"
MASK_ID = 330
SMALL_BUFFERS = dict(bucket_buffer_size=40, shuffle_buffer_size=40, bucket_estimate_samples=40, num_buckets=3)


def _cuts(path):
    return InputConfig(type="lhotse_as_conversation", cuts_path=str(path))


def _module(target, estimator, train_inputs, val_inputs=None, seed=3, rank=0, world_size=1, **split):
    split = {**SMALL_BUFFERS, **split}
    cfg = DataConfig(
        train_ds=DatasetConfig(input_cfg=train_inputs, **split),
        validation_ds=DatasetConfig(input_cfg=val_inputs, **split) if val_inputs else None,
    )
    return SpeechDataModule(cfg, target.tokenizer, TAG, estimator, seed=seed, rank=rank, world_size=world_size)


def _splice(target, batch):
    return target.splice_batch(batch, MASK_ID)


def _train_batches(module, n):
    return list(islice(iter(module.train_dataloader()), n))


@pytest.mark.parametrize("bucketing", [True, False])
def test_padded_batches_never_exceed_the_token_budget_after_splicing(tiny_target, audio_estimator, demo_data,
                                                                      bucketing):
    budget = 420
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=budget, max_tokens=140,
                     use_bucketing=bucketing)
    rows = []
    for batch in _train_batches(module, 8):
        spliced = _splice(tiny_target, batch)
        width = spliced.input_ids.shape[1]
        assert width * len(batch.sample_ids) <= budget  # padding included
        assert width == int(spliced.lengths.max())
        for i, n in enumerate(batch.lengths.tolist()):  # right padding: nothing real after a row's length
            assert (batch.input_ids[i, n:] == tiny_target.pad_id).all() and not batch.loss_mask[i, n:].any()
        rows.append(len(batch.sample_ids))
    # Lengths here are ~90-130 positions: bucketing fits 3-4 rows; without it every batch must leave room
    # for a max_tokens (140) sample, so 420 // 140 = 3 rows.
    assert max(rows) >= 3 and (bucketing or set(rows) == {3})


@pytest.mark.parametrize("packing", [False, True])
def test_loader_batches_carry_their_splice_placements_and_splice_alike_without_them(
        tiny_target, audio_estimator, demo_data, packing):
    """The collator computes row lengths and placeholder positions on the CPU, so the step reads
    none back from the device; they must be what the tensors say and splice to the same batch."""
    from dataclasses import replace

    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=420, max_tokens=140,
                     packing=packing)
    for batch in _train_batches(module, 3):
        assert batch.row_lengths == batch.lengths.tolist()
        tag = tiny_target.audio_locator_tag_id
        expected = [[p for p in range(n) if batch.input_ids[i, p] == tag] for i, n in enumerate(batch.row_lengths)]
        assert batch.audio_positions == expected and sum(map(len, expected)) == sum(batch.audios_per_row) > 0
        assert batch.supervised_tokens == int(batch.loss_mask.sum()) > 0
        assert batch.max_documents == (1 if batch.document_ids is None else int(batch.document_ids.max()) + 1)
        with_host = _splice(tiny_target, batch)
        read_back = _splice(tiny_target, replace(batch, row_lengths=None, audio_positions=None, audio_frames=None))
        for name in ("inputs_embeds", "input_ids", "loss_mask", "attention_mask", "audio_mask", "lengths"):
            assert torch.equal(getattr(with_host, name), getattr(read_back, name)), name
        # the runway is a lower bound of the spliced rows' room after a supervised token (splicing adds positions)
        documents = with_host.document_ids if packing else torch.where(with_host.attention_mask, 0, -1)
        remaining = document_layout(documents).doc_remaining
        assert 0 < batch.anchor_runway <= int(remaining[with_host.loss_mask.bool()].max())


def test_the_anchor_runway_counts_text_after_a_supervised_token_but_not_audio_or_the_first_token():
    from dflash_train.data.collate import anchor_runway
    from dflash_train.data.examples import Example

    tag = 9
    ids = np.array([1, tag, 2, 3, 4, tag, 5, 6])  # supervised: positions 3 and 6
    mask = np.array([0, 0, 0, 1, 0, 0, 1, 0], dtype=bool)
    example = Example("e", ids, mask, [], [], 8, 2, 1.0)
    assert anchor_runway(example, tag) == 3  # after position 3: positions 4, 6, 7 (the placeholder at 5 not counted)
    first_only = Example("f", ids, np.array([1, 0, 0, 0, 0, 0, 0, 0], dtype=bool), [], [], 8, 1, 1.0)
    assert anchor_runway(first_only, tag) == -1  # a document's first token never counts


def test_estimated_lengths_equal_spliced_lengths(tiny_target, audio_estimator, demo_data):
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_size=4, use_bucketing=False)
    examples = {ex.id: ex for ex in islice(iter(module.train_examples()), 20)}
    for batch in _train_batches(module, 3):
        spliced = _splice(tiny_target, batch)
        assert spliced.lengths.tolist() == [examples[i].num_tokens for i in batch.sample_ids]


def test_fixed_batch_size_mode(tiny_target, audio_estimator, demo_data):
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_size=5)
    assert [len(b.sample_ids) for b in _train_batches(module, 6)] == [5] * 6


def test_packed_rows_hold_whole_documents_with_correct_layout(tiny_target, audio_estimator, demo_data):
    budget = 600
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=budget, max_tokens=150,
                     packing=True, use_bucketing=True)
    examples = {ex.id: ex for ex in islice(iter(module.train_examples()), 20)}
    for batch in _train_batches(module, 5):
        assert batch.input_ids.shape[0] == 1 and len(batch.sample_ids) == 1
        doc_ids = batch.sample_ids[0].split("+")
        spliced = _splice(tiny_target, batch)
        assert int(spliced.lengths[0]) <= budget
        expected_lengths = [examples[i].num_tokens for i in doc_ids]
        assert int(spliced.lengths[0]) == sum(expected_lengths)
        layout = document_layout(spliced.document_ids)
        assert layout.seq_lens[0].tolist() == expected_lengths
        start = 0
        for d, length in enumerate(expected_lengths):
            span = slice(start, start + length)
            assert spliced.document_ids[0, span].tolist() == [d] * length
            assert layout.position_ids[0, span].tolist() == list(range(length))
            assert layout.doc_remaining[0, span].tolist() == list(range(length - 1, -1, -1))
            # each document carries its own sample's tokens and loss mask
            text = batch.input_ids[0, batch.document_ids[0] == d]
            assert text.tolist() == examples[doc_ids[d]].input_ids.tolist()
            start += length
        assert len(doc_ids) >= 2  # rows really pack several documents


def test_document_layout_on_a_hand_built_row():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1]])
    layout = document_layout(docs)
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0]]
    assert layout.seq_lens.tolist() == [[3, 2, 4], [7, 0, 0]]
    assert layout.doc_remaining.tolist() == [[2, 1, 0, 1, 0, 3, 2, 1, 0, -1, -1], [6, 5, 4, 3, 2, 1, 0, -1, -1, -1, -1]]


def test_no_anchor_sampled_by_automodel_crosses_a_document(tiny_target, audio_estimator, demo_data):
    from nemo_automodel.components.speculative.dflash.core import DFlashTrainerModule, _context_doc_ids

    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=800, max_tokens=150,
                     packing=True)
    block = 8
    sampler = SimpleNamespace(block_size=block, num_anchors=10_000)
    torch.manual_seed(0)
    checked = 0
    for batch in _train_batches(module, 3):
        spliced = _splice(tiny_target, batch)
        layout = document_layout(spliced.document_ids)
        seq_len = spliced.input_ids.shape[1]
        # automodel derives document ids from seq_lens; they must agree with ours on every real token
        derived = _context_doc_ids(layout.seq_lens, seq_len, torch.device("cpu"))
        n = int(spliced.lengths[0])
        assert derived[0, :n].tolist() == spliced.document_ids[0, :n].tolist()
        anchors, keep = DFlashTrainerModule._sample_anchor_positions(
            sampler, seq_len, spliced.loss_mask.float(), torch.device("cpu"), doc_remaining=layout.doc_remaining
        )
        for a in anchors[0][keep[0]].tolist():
            block_docs = spliced.document_ids[0, a : a + block].tolist()
            assert len(block_docs) == block and len(set(block_docs)) == 1 and spliced.loss_mask[0, a]
            checked += 1
        # every supervised position with a full block left in its document was a candidate
        candidates = spliced.loss_mask[0] & (layout.doc_remaining[0] >= block - 1)
        assert int(keep[0].sum()) == int(candidates[: seq_len - block + 1].sum())
    assert checked > 50


def test_two_ranks_see_disjoint_samples_and_every_validation_sample_once(tiny_target, audio_estimator, demo_data,
                                                                          tmp_path):
    val = tmp_path / "val.jsonl.gz"
    CutSet.from_file(demo_data[0]).subset(first=12).to_file(val)
    ids_in_file = [c.id for c in CutSet.from_file(demo_data[0])]

    def module(rank, world_size):
        return _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], [_cuts(val)], rank=rank,
                       world_size=world_size, batch_size=2, use_bucketing=False, shuffle=False)

    # Training: rank r owns records r, r + 2, ... of every input and only ever sees those.
    for rank in (0, 1):
        seen = {i for b in _train_batches(module(rank, 2), 12) for i in b.sample_ids}
        assert seen == set(ids_in_file[rank::2])
    assert [b.sample_ids for b in _train_batches(module(1, 2), 2)] == [ids_in_file[1:4:2], ids_in_file[5:8:2]]
    # Validation: every sample exactly once over both ranks, the same number of batches on each.
    seen = [[b.sample_ids for b in module(r, 2).val_dataloader()[0]] for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 3
    flat = [sum(s, []) for s in seen]
    assert set(flat[0]).isdisjoint(flat[1]) and sorted(flat[0] + flat[1]) == sorted(ids_in_file[:12])


def test_same_seed_same_batches_other_seed_other_order(tiny_target, audio_estimator, demo_data):
    def ids(seed, workers=0):
        module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], seed=seed, batch_tokens=400,
                         max_tokens=140, num_workers=workers)
        return [b.sample_ids for b in _train_batches(module, 6)]

    first = ids(11)
    assert ids(11) == first
    assert ids(11, workers=2) == first  # audio loading in worker processes changes nothing
    assert ids(12) != first


def test_a_resumed_run_continues_the_stream_after_the_trained_batches(tiny_target, audio_estimator, demo_data):
    def module():
        return _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=400, max_tokens=140)

    fresh = [b.sample_ids for b in _train_batches(module(), 7)]
    resumed = module()
    progress = SimpleNamespace(total=SimpleNamespace(processed=4))
    resumed.trainer = SimpleNamespace(global_rank=0, world_size=1,
                                      fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    assert [b.sample_ids for b in _train_batches(resumed, 3)] == fresh[4:]


def test_inputs_are_blended_by_weight(tiny_target, audio_estimator, demo_data, tmp_path):
    cuts = CutSet.from_file(demo_data[0]).to_eager()
    CutSet(list(cuts)[:10]).to_file(tmp_path / "a.jsonl.gz")
    CutSet(list(cuts)[10:]).to_file(tmp_path / "b.jsonl.gz")
    a_ids = {c.id for c in list(cuts)[:10]}
    inputs = [_cuts(tmp_path / "a.jsonl.gz"), _cuts(tmp_path / "b.jsonl.gz")]
    inputs[0].weight = 3.0
    module = _module(tiny_target, audio_estimator, inputs, batch_size=4)
    drawn = [ex.id for ex in islice(iter(module.train_examples()), 400)]
    from_a = sum(i in a_ids for i in drawn)
    assert 270 <= from_a <= 330  # 3:1 blend, binomial sd ~9
    assert drawn == [ex.id for ex in islice(iter(module.train_examples()), 400)]


def test_skip_counts_are_split_across_ranks_and_sum_to_the_total(tiny_target, audio_estimator, demo_data, tmp_path):
    cuts = list(CutSet.from_file(demo_data[0]))
    for cut in cuts[::3]:
        cut.supervisions = []
    CutSet(cuts).to_file(tmp_path / "some_bad.jsonl.gz")
    bad = len(cuts[::3])
    for split in ("train", "validation"):
        counts = []
        for rank, world_size in ((0, 1), (0, 2), (1, 2)):
            module = _module(tiny_target, audio_estimator, [_cuts(tmp_path / "some_bad.jsonl.gz")],
                             [_cuts(tmp_path / "some_bad.jsonl.gz")], rank=rank, world_size=world_size, batch_size=4)
            examples = module.train_examples() if split == "train" else module.validation_examples("some_bad")
            list(islice(iter(examples), 3 * len(cuts)))  # training re-reads its shard: still counted once
            counts.append(module.skip_counts()["no_supervision"])
        assert counts[0] == bad and counts[1] + counts[2] == bad and 0 < counts[1] < bad, split


def test_measure_total_length_off_budgets_only_the_prompt_part():
    ex = SimpleNamespace(num_tokens=100, num_supervised=30)
    assert TokenBudget(batch_tokens=200).measure_length(ex) == 100
    assert TokenBudget(batch_tokens=200, measure_total_length=False).measure_length(ex) == 70
    strict = TokenBudget(batch_tokens=250, max_tokens=100, bins=[60])
    strict.add(SimpleNamespace(num_tokens=50, num_supervised=0))  # bucket edge 60: room for 4 rows of 60
    assert not strict.close_to_exceeding()
    for _ in range(3):
        strict.add(SimpleNamespace(num_tokens=55, num_supervised=0))
    assert strict.close_to_exceeding() and not strict.exceeded()


def test_loader_settings_reach_the_dataloader(tiny_target, audio_estimator, demo_data):
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_size=2, num_workers=1,
                     prefetch_factor=3, pin_memory=False)
    loader = module.train_dataloader()
    assert (loader.num_workers, loader.prefetch_factor, loader.pin_memory, loader.persistent_workers) == (1, 3, False, True)
    batch = next(iter(loader))
    assert len(batch.sample_ids) == 2


def test_prefetch_without_workers_is_a_one_line_error(tiny_target, audio_estimator, demo_data):
    from dflash_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prefetch_factor=4 needs num_workers > 0"):
        _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_size=2, num_workers=0, prefetch_factor=4)


@pytest.mark.parametrize("packing", [False, True])
def test_the_exposure_estimate_counts_the_anchors_training_draws(tiny_target, audio_estimator, demo_data, packing):
    """dflash-exposure's expected anchors against automodel's own sampler on the same real batches."""
    from nemo_automodel.components.speculative.dflash.core import DFlashTrainerModule

    from dflash_train.data.collate import collate_packed, collate_padded
    from dflash_train.data.exposure import expected_anchors
    from dflash_train.data.sampling import build_sampler, train_shuffle

    block, cap = 8, 24
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], batch_tokens=900, max_tokens=200,
                     packing=packing)
    ds = module.cfg.train_ds
    sampler = build_sampler(module.train_examples(), ds, train_shuffle(ds), 0, rank=0, world_size=1)
    core = SimpleNamespace(block_size=block, num_anchors=cap)
    tag = tiny_target.audio_locator_tag_id
    torch.manual_seed(0)
    compared = 0
    for examples in islice(sampler, 4):
        examples = list(examples)
        batch = (collate_packed(examples, "train") if packing else collate_padded(examples, tiny_target.pad_id, "train"))
        batch = batch.with_placements(tag)
        spliced = tiny_target.splice_batch(batch, tiny_target.pad_id)
        doc_ids = spliced.document_ids if packing else torch.where(spliced.attention_mask, 0, -1)
        layout = document_layout(doc_ids)
        _, keep = DFlashTrainerModule._sample_anchor_positions(
            core, spliced.input_ids.shape[1], spliced.loss_mask.float(), torch.device("cpu"),
            doc_remaining=layout.doc_remaining,
        )
        expected = expected_anchors(examples, tag, block, cap, packed=packing)
        drawn = keep.sum(dim=1).tolist()
        if packing:  # one row: the draw is random, its size is not
            assert sum(drawn) == pytest.approx(sum(expected))
        else:
            assert drawn == expected
        compared += len(examples)
    assert compared > 4
