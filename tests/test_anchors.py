"""The anchor draw per row or per packed document (``dflash.anchor_budget``) and the coverage it logs, each
checked against a direct computation, and a packed run where a per-row budget starves short documents."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import demo_recipe

from dflash_train.draft.anchors import anchor_coverage, documents_of, draw_anchors


def _packed_row(lengths: list[int], unsupervised: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(documents [1, S], supervised [1, S])`` of one packed row: each document's first ``unsupervised``
    positions (its prompt) unsupervised, then padding of 3."""
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)] + [torch.full((3,), -1)])[None]
    supervised = torch.zeros_like(documents, dtype=torch.bool)
    start = 0
    for n in lengths:
        supervised[0, start + unsupervised:start + n] = True
        start += n
    return documents, supervised


def _lowest_scores(valid, documents, budget, scores):
    """Directly: in each row and document, the ``budget`` valid positions of lowest score."""
    chosen = []
    for row in range(valid.shape[0]):
        picked = []
        for doc in (documents[row].unique().tolist() if documents is not None else [None]):
            positions = [p for p in range(valid.shape[1]) if valid[row, p] and (doc is None or documents[row, p] == doc)]
            picked += sorted(positions, key=lambda p: scores[row, p].item())[:budget]
        chosen.append(sorted(picked))
    return chosen


@pytest.mark.parametrize("per_document", [True, False])
def test_the_draw_takes_the_lowest_scores_of_each_document_or_row(per_document):
    documents = torch.stack([_packed_row([30, 5, 9, 4])[0][0], _packed_row([12, 26, 10])[0][0]])
    valid = (documents >= 0) & (torch.rand(documents.shape, generator=torch.Generator().manual_seed(1)) < 0.8)
    torch.manual_seed(7)
    scores = torch.rand(valid.shape)
    torch.manual_seed(7)
    anchors, keep = draw_anchors(valid, 3, documents if per_document else None)
    expected = _lowest_scores(valid, documents if per_document else None, 3, scores)
    assert [anchors[r][keep[r]].tolist() for r in range(2)] == expected
    assert anchors.shape[1] == max(len(row) for row in expected) and not anchors[~keep].any()


def test_documents_are_numbered_from_the_tokens_left_in_them():
    remaining = torch.tensor([[2, 1, 0, 1, 0, 3, 2, 1, 0, -1, -1]])
    assert documents_of(remaining).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1]]


def test_coverage_is_the_fraction_of_each_documents_supervision_a_block_predicts():
    documents, supervised = _packed_row([10, 6, 8])
    anchors, keep = torch.tensor([[3, 17, 0]]), torch.tensor([[True, True, False]])
    sums = anchor_coverage(anchors, keep, 3, supervised, documents)
    # directly: predicted positions 4..6 and 18..20; supervised: 2..9, 12..15, 18..23
    direct = [len({4, 5, 6} & set(range(2, 10))) / 8, 0 / 4, len({18, 19, 20} & set(range(18, 24))) / 6]
    assert sums.tolist() == pytest.approx([sum(direct), 3, 1])


def test_a_per_row_budget_starves_the_short_documents_of_a_packed_row():
    documents, supervised = _packed_row([200, 10, 10, 10, 10])
    remaining = torch.zeros_like(documents)
    for d in range(5):
        where = (documents == d).nonzero()[:, 1]
        remaining[0, where] = torch.arange(len(where) - 1, -1, -1)
    remaining[documents < 0] = -1
    valid = supervised & (remaining >= 3)
    figures = {}
    for per_document in (False, True):
        totals = torch.zeros(3, dtype=torch.float64)
        for seed in range(20):
            torch.manual_seed(seed)
            anchors, keep = draw_anchors(valid, 8, documents_of(remaining) if per_document else None)
            totals += anchor_coverage(anchors, keep, 3, supervised, documents)
        figures[per_document] = (totals[0] / totals[1]).item(), (totals[2] / totals[1]).item()
    print(f"coverage per row {figures[False][0]:.3f} ({figures[False][1]:.0%} of documents without a block), "
          f"per document {figures[True][0]:.3f} ({figures[True][1]:.0%})")
    assert figures[True][1] == 0 and figures[False][1] > 0.2
    assert figures[True][0] > 2 * figures[False][0]


def _logged(run_dir, column: str) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(row[column]) for row in csv.DictReader(f) if row.get(column)]


@pytest.mark.parametrize("variant", ["dflash", "mtp"])
def test_a_packed_run_logs_its_coverage_and_a_per_document_budget_raises_it(tiny_salm_dir, demo_data, tmp_path,
                                                                           variant):
    from dflash_train.training.recipe import train

    packed = ["data.train_ds.packing=true", "data.train_ds.batch_tokens=1024", "data.train_ds.use_bucketing=false",
              f"dflash={variant}", "dflash.num_anchors=2", "trainer.max_steps=3", "trainer.val_check_interval=3",
              "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "dflash.serving_val_samples=0"]
    coverage = {}
    for budget in ("per_row", "per_document"):
        run_dir = tmp_path / budget
        train(demo_recipe(tiny_salm_dir, demo_data, run_dir, *packed, f"dflash.anchor_budget={budget}"))
        coverage[budget] = _logged(run_dir, "train/anchor_coverage"), _logged(run_dir, "train/documents_without_block")
    print(f"anchor coverage per step: {coverage}")
    (per_row, row_unreached), (per_document, document_unreached) = coverage["per_row"], coverage["per_document"]
    assert len(per_row) == len(per_document) == 3 and all(0 < value <= 1 for value in per_row + per_document)
    assert all(d > r for d, r in zip(per_document, per_row)) and max(document_unreached) < min(row_unreached)


def _trainer_core(block_size: int, num_anchors: int, budget: str):
    """The trainer core a run builds (the block family's ``build_core``, as ``DFlashDraftModule`` calls it) for a
    tiny Qwen3-shaped target: only its anchor draw is used here."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from dflash_train.draft import DraftSpec
    from dflash_train.draft.family import family_of
    from dflash_train.variants import variant_named

    llm = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    target = SimpleNamespace(llm_config=llm, lm_head=torch.nn.Linear(32, 64, bias=False),
                             embed_tokens=torch.nn.Embedding(64, 32))
    cfg = variant_named("dflash").config_schema(block_size=block_size, num_anchors=num_anchors, anchor_budget=budget,
                                                draft_num_hidden_layers=1)
    spec = DraftSpec(cfg, (0, 1), 63, 2)
    family = family_of(spec.variant)
    return family.build_core(family.build_draft(target, spec, "sdpa"), target, spec, "sdpa", False)


@pytest.mark.parametrize("budget", ["per_document", "per_row"])
def test_every_drawn_anchor_has_its_whole_block_inside_its_document(budget):
    """Guards the anchor validity rule of nemo_automodel's DFlash core (``_sample_anchor_positions``): an anchor
    ``a`` is supervised and its whole block ``a .. a + block_size - 1`` lies inside ``a``'s document
    (``doc_remaining >= block_size - 1``), else the block is supervised on the next document's tokens. Checked
    on the trainer core a run builds, for both budgets, over random packed rows whose documents are around
    ``block_size`` long, with a budget large enough that every valid position is drawn. The per-document draw
    accepting one position too late (``doc_remaining >= block_size - 2``) fails here at the first row."""
    from dflash_train.data.packing import document_layout

    block_size, width = 4, 40
    core = _trainer_core(block_size, num_anchors=width, budget=budget)
    generator = torch.Generator().manual_seed(0)
    checked = late = 0
    for trial in range(60):
        rows = []
        for _ in range(3):  # documents of block_size - 2 .. block_size + 2 tokens, the rest padding
            lengths = []
            while sum(lengths) < width - block_size - 3:
                lengths.append(int(torch.randint(block_size - 2, block_size + 3, (1,), generator=generator)))
            rows.append(torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]
                                  + [torch.full((width - sum(lengths),), -1)]))
        doc_ids = torch.stack(rows)
        layout = document_layout(doc_ids, int(doc_ids.max()) + 1)
        supervised = (doc_ids >= 0) & (torch.rand(doc_ids.shape, generator=generator) < 0.9)
        torch.manual_seed(trial)
        anchors, keep = core._sample_anchor_positions(width, supervised.float(), torch.device("cpu"),
                                                      doc_remaining=layout.doc_remaining)
        assert keep.any()
        for row in range(doc_ids.shape[0]):
            for a in anchors[row][keep[row]].tolist():
                last = a + block_size - 1
                inside = last < width and bool((doc_ids[row, a:last + 1] == doc_ids[row, a]).all())
                assert supervised[row, a] and doc_ids[row, a] >= 0, f"anchor {a} of row {row} is not supervised"
                assert inside, (f"trial {trial}, row {row}: anchor {a} (document {int(doc_ids[row, a])}) has its block "
                                f"{a}..{last} leave its document: {doc_ids[row, a:last + 1].tolist()}")
                checked += 1
        late += int((supervised & (layout.doc_remaining == block_size - 2)).sum())
    assert checked > 1000 and late > 100  # many anchors, and many positions one too late to be one
