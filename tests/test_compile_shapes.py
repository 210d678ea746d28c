"""Compiled flex runs: many batch shapes, few compiled entries, and a recompile limit hit is one line.

The draft step of a flex run calls two compiled functions: our flex attention and nemo_automodel's
compiled block-mask builder. Real speech batches change shape every step (rows, padded length,
anchors), and validation flips the grad mode. Here ≥ 20 distinct realistic batch shapes go through the
real module (tiny SALM target, DFlash2 draft on flex attention, stable shapes as flex runs use them)
in both grad modes, compiled by inductor on CPU, and the cache entries of each compiled function are
counted. flex_attention has no backward on CPU, so the training-mode pass runs the forward with
gradients enabled (the grad-mode class a training step compiles) and a frozen draft. The mask builder
is compiled by inductor as in training; the attention by "aot_eager" (the same dynamo guards and
entries; inductor's CPU flex kernel fails on some of these shapes, a torch 2.13 CPU bug the GPU
kernel does not share).
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose, tiny_run_overrides

from dflash_train.config import validate_config
from dflash_train.data.packing import document_layout
from dflash_train.draft import DraftSpec, build_draft
from dflash_train.draft import attention
from dflash_train.draft.attention import FLEX_LENGTH_MULTIPLE, FlexRecompileError, compiled_entries
from dflash_train.training.module import DFlashDraftModule, ModuleSettings, StepInputs, pad_to_multiple

LAYERS = (1, 3)

# (rows, documents per row, prompt length, reply length): ASR-like rows, packed rows, one long row (a long
# recording: its prompt holds the audio), short packed documents. Padded lengths 128, 384, 768, 256; anchors per
# row (rounded to 16) 32, 112, 96, 48. The draft's work grows with its anchors (a block of queries each) more than
# with the context: replies of at most 100 tokens keep the 40 forwards cheap on CPU.
SHAPES = [(rows, docs, prompt, reply) for rows in (1, 2, 3, 5, 8) for docs, prompt, reply in
          ((1, 40, 30), (2, 90, 60), (1, 600, 100), (3, 30, 20))]


def _inputs(target, rows: int, docs: int, prompt: int, reply: int, seed: int) -> StepInputs:
    """A batch as ``module.prepare`` lays it out: per document a prompt (unsupervised) then a reply."""
    generator = torch.Generator().manual_seed(seed)
    length = docs * (prompt + reply) + (seed % 7)  # rows end at different places: padding differs too
    documents = torch.full((rows, length), -1)
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    for row in range(rows):
        end = length - (row % 3) * 5
        for doc in range(docs):
            start = doc * (prompt + reply)
            documents[row, start : min(start + prompt + reply, end)] = doc
            loss_mask[row, start + prompt : min(start + prompt + reply, end)] = True
    layout = document_layout(documents)
    width = len(LAYERS) * target.llm_config.hidden_size
    inputs = StepInputs(
        torch.randint(0, target.vocab_size, (rows, length), generator=generator),
        torch.randn(rows, length, width, generator=generator),
        loss_mask,
        layout.position_ids,
        layout.seq_lens,
        layout.doc_remaining,
    )
    return pad_to_multiple(inputs, FLEX_LENGTH_MULTIPLE)


@pytest.fixture(scope="module")
def flex_module(tiny_salm_dir, tiny_target):
    attention.FLEX_COMPILE_BACKEND = "aot_eager"
    attention._compiled_flex_attention.cache_clear()
    cfg = validate_config(compose("dflash", tiny_run_overrides(tiny_salm_dir) + ["dflash=dflash2", "dflash.selector_rank=16"])).run.dflash
    spec = DraftSpec(cfg, LAYERS, 320, tiny_target.num_layers)
    torch.manual_seed(0)
    draft = build_draft(tiny_target.llm_config, spec, "flex_attention").requires_grad_(False)
    settings = ModuleSettings(layer_ids=list(LAYERS), attention_backend="flex_attention")
    yield DFlashDraftModule(tiny_target, draft, spec, settings)
    attention.FLEX_COMPILE_BACKEND = "inductor"
    attention._compiled_flex_attention.cache_clear()


def test_warming_compiles_the_four_classes_and_twenty_batch_shapes_in_both_grad_modes_add_none(flex_module,
                                                                                              tiny_target):
    """What ``on_fit_start`` does for a flex run: the warm-up compiles one entry per class (grad mode × one row
    or more) of each function, and afterwards ≥ 20 batch shapes in both grad modes compile nothing new."""
    torch._dynamo.reset()
    flex_module.warm_shape_classes()
    warmed = compiled_entries()
    assert warmed == {"flex_attention": 4, "create_block_mask": 4}, warmed
    seen = set()
    for grad in (True, False):
        for index, shape in enumerate(SHAPES):
            inputs = _inputs(tiny_target, *shape, seed=index)
            with torch.set_grad_enabled(grad):
                metrics = flex_module.run_core(inputs, rng_key=index)
            assert float(metrics.valid_tokens) > 0
            seen.add(tuple(inputs.input_ids.shape))
    print(f"{len(seen)} batch shapes x 2 grad modes -> compiled entries {compiled_entries()}")
    assert len(seen) >= 20
    assert compiled_entries() == warmed


def test_a_recompile_limit_hit_is_one_line_naming_the_knob(flex_module, tiny_target):
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1
    try:
        flex_module.run_core(_inputs(tiny_target, 2, 1, 40, 30, seed=0), rng_key=0)
        with pytest.raises(FlexRecompileError, match="raise dflash.compile_recompile_limit") as caught:
            flex_module.run_core(_inputs(tiny_target, 1, 1, 40, 30, seed=0), rng_key=0)  # one row: the other class
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()
    assert "\n" not in str(caught.value)
