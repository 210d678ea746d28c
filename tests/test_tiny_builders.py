"""The tiny builders' command lines: a target of the shape asked, which the project's target loader opens, and
one line saying where it is and how to use it; a bad argument is one line and writes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.config.schema import ModelConfig
from dflash_train.target import open_speech_target
from dflash_train.testing import tiny_mtp_salm, tiny_salm

SHAPE = ["--hidden-size", "96", "--attention-heads", "4", "--kv-heads", "2", "--vocab", "400",
         "--tokenizer-vocab", "300"]
"""Sizes away from every default: hidden 96, 4 query / 2 key-value heads, 300 tokens and 100 spare rows."""


def _build_and_load(main, out, argv, capsys):
    """Run a builder's command line with :data:`SHAPE` and ``argv``; check its one line of output and the shape
    the target loader finds; return the loaded target."""
    assert main(["--out", str(out), *SHAPE, *argv]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(f"wrote {out.resolve()}: ") and line.endswith(f"model.pretrained_name={out.resolve()}")
    target = open_speech_target(ModelConfig(pretrained_name=str(out)))
    assert (target.hidden_size, target.vocab_size, len(target.tokenizer.tokenizer)) == (96, 400, 300)
    config = target.llm_config
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    logits = target.causal_lm(inputs_embeds=target.embed_tokens(torch.tensor([[1, 2, 3]]))).logits
    assert logits.shape == (1, 3, 400) and torch.isfinite(logits).all()
    return target


def test_the_salm_builder_writes_the_shape_asked(tmp_path, capsys):
    out = tmp_path / "salm"
    target = _build_and_load(tiny_salm.main, out, ["--layers", "3"], capsys)
    assert target.num_layers == 3
    backbone = json.loads((out / "llm_backbone" / "config.json").read_text())
    assert (backbone["hidden_size"], backbone["num_hidden_layers"], backbone["vocab_size"]) == (96, 3, 400)


def test_the_mtp_builder_writes_the_blocks_and_experts_asked(tmp_path, capsys):
    from dflash_train.draft.mtp import MTPStep

    out = tmp_path / "nemotron_h"
    argv = ["--backbone-pattern", "M*E-", "--experts", "6", "--experts-per-token", "3", "--mamba-heads", "6",
            "--mamba-head-dim", "8", "--heads", "1"]
    target = _build_and_load(tiny_mtp_salm.main, out, argv, capsys)
    config = target.llm_config
    assert (config.hybrid_override_pattern, target.num_layers) == ("M*E-", 4)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.mamba_num_heads, config.mamba_head_dim) == (
        6, 3, 6, 8)
    step, heads = MTPStep.from_checkpoint(out)
    assert heads == 1 and step.eh_proj.weight.shape == (96, 192)


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (tiny_salm.main, ["--attention-heads", "3", "--kv-heads", "2"], "--attention-heads 3 is not a multiple of"),
        (tiny_salm.main, ["--layers", "0"], "argument --layers: '0' is not an integer >= 1"),
        (tiny_salm.main, ["--vocab", "100"], "--vocab 100 has fewer rows than the tokenizer's 320 tokens"),
        (tiny_salm.main, ["--tokenizer-vocab", "600", "--vocab", "700"], "a 600-token tokenizer cannot be trained"),
        (tiny_mtp_salm.main, ["--layers", "3"], "--layers 3 is for --backbone qwen3"),
        (tiny_mtp_salm.main, ["--backbone-pattern", "M*X"], "backbone pattern 'M*X': Nemotron-H blocks are"),
        (tiny_mtp_salm.main, ["--experts", "2", "--experts-per-token", "3"], "3 experts per token out of 2"),
    ],
)
def test_a_bad_argument_is_one_line_and_writes_nothing(tmp_path, capsys, main, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"python -m {main.__module__}: error: ") and message in line


def test_help_lists_every_size_with_its_default(capsys):
    with pytest.raises(SystemExit):
        tiny_mtp_salm.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--hidden-size N the LLM's hidden size (default: 64)", "--attention-heads N query heads (default: 2)",
                   "--vocab N", "(default: 384)", "--backbone-pattern", "(default: *-*-)",
                   "--experts N an E block's routed experts (default: 4)", "--heads N MTP heads"):
        assert option in text
