"""The predicted table of docs/benchmarks.md ("Predicted fit and step bound: dflash-plan"): the run configs of
the two public targets, planned by :func:`dflash_train.plan.plan_run` on H100 and H200 at 128 / 512 / 1024
anchors and 8 / 16 / 64 ranks. Nothing runs on a GPU and no weight exists: each target is a tiny builder's
checkpoint with its config files scaled to the public model's shapes and its weights file removed.

* ``canary``: conf/canary_qwen_2_5b.yaml on a canary-qwen-2.5b-shaped SALM (dflash_train/testing/tiny_salm.py);
* ``lightning``: conf/nemotron_lightning_speechlm.yaml (``ep_size`` 8, the runbook's six taps, 30 s encoder
  chunks) on a Nemotron-3.5-Lightning-shaped SpeechLM (dflash_train/testing/tiny_mtp_salm.py ``LIGHTNING``).

    python benchmarks/plan_table.py [--targets canary lightning] [--out DIR] [--anchors 128 512 1024]
                                    [--ranks 8 16 64] [--gpus h100 h200] [--families dflash eagle3 ...] [--json FILE]

Prints the Markdown rows (and ``--json FILE`` writes every plan). ``--families`` plans other draft families on the
same run configs (``dflash=<family>``; EAGLE-3 with ``dflash.target_layer_ids=null``, its three taps derived from
the target's depth, and MTP without taps, as the run configs list the block drafts'), each row naming its family.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

CANARY_QWEN_LLM = {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True}
"""Qwen3-1.7B, canary-qwen-2.5b's LLM (its config.json)."""

CANARY_ENCODER = {"d_model": 1024, "n_layers": 32, "n_heads": 8, "feat_in": 128, "ff_expansion_factor": 4,
                  "subsampling_conv_channels": 256}
"""canary-1b-flash's FastConformer encoder, canary-qwen-2.5b's perception (conf/canary_qwen_2_5b.yaml)."""


def canary_qwen_shaped(out: Path) -> Path:
    """A canary-qwen-2.5b-shaped SALM checkpoint directory of config files only (no weights file)."""
    from dflash_train.testing.tiny_salm import build_tiny_salm

    target = build_tiny_salm(out)
    (target / "model.safetensors").unlink()
    llm_file = target / "llm_backbone" / "config.json"
    llm = json.loads(llm_file.read_text())
    llm.update(CANARY_QWEN_LLM)
    llm["layer_types"] = ["full_attention"] * llm["num_hidden_layers"]
    llm_file.write_text(json.dumps(llm, indent=2))
    _scale_perception(target, CANARY_QWEN_LLM["hidden_size"])
    return target


LIGHTNING_LLM = {"hidden_size": 2688, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                 "intermediate_size": 1856, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
                 "n_routed_experts": 128, "num_experts_per_tok": 6, "mamba_num_heads": 64, "mamba_head_dim": 64,
                 "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2, "vocab_size": 131072}
"""Nemotron 3.5 Lightning 30B-A3B's backbone at full width (Nemotron-3-Nano-30B-A3B's published shapes: the same
52-block pattern, 128 routed experts top-6 plus a shared expert); the tiny preset already has its block pattern."""


def lightning_shaped(out: Path) -> Path:
    """A Nemotron-3.5-Lightning-shaped SpeechLM checkpoint directory of config files only (no weights file): the
    backbone at :data:`LIGHTNING_LLM`, the perception a canary-sized FastConformer projected to 2688 (the
    SpeechLM's own encoder is not public; assumed the size of canary-qwen-2.5b's)."""
    from dflash_train.constants import LLM_BACKBONE_DIR
    from dflash_train.testing.tiny_mtp_salm import LIGHTNING, build_tiny_mtp_salm

    target = build_tiny_mtp_salm(out, LIGHTNING)
    (target / "model.safetensors").unlink()
    llm_file = target / LLM_BACKBONE_DIR / "config.json"
    llm = json.loads(llm_file.read_text())
    llm.update(LIGHTNING_LLM)
    llm_file.write_text(json.dumps(llm, indent=2))
    _scale_perception(target, LIGHTNING_LLM["hidden_size"])
    return target


def _scale_perception(target: Path, llm_width: int) -> None:
    config_file = target / "config.json"
    config = json.loads(config_file.read_text())
    perception = config["perception"]
    perception["encoder"].update(CANARY_ENCODER)
    perception["preprocessor"]["features"] = CANARY_ENCODER["feat_in"]
    perception["modality_adapter"].update(d_model=CANARY_ENCODER["d_model"], feat_in=CANARY_ENCODER["d_model"],
                                          n_heads=8, n_layers=2)
    perception["output_dim"] = llm_width
    config_file.write_text(json.dumps(config, indent=2))


TARGETS = {"canary": ("canary-qwen-2.5b (shaped)", "canary_qwen_2_5b", canary_qwen_shaped),
           "lightning": ("Nemotron-3.5-Lightning (shaped), ep 8", "nemotron_lightning_speechlm",
                         lightning_shaped)}
"""``--targets``: the table's name, the run config (conf/) and the builder of the config-only checkpoint."""


def family_overrides(family: str | None) -> list[str]:
    """The overrides that train ``family`` on a run config (none: the config's own family)."""
    taps = {"eagle3": ["dflash.target_layer_ids=null"], "mtp": ["~dflash.target_layer_ids"]}
    return [] if family is None else [f"dflash={family}", *taps.get(family, [])]


def plan_row(target: Path, work: Path, gpu: str, ranks: int, anchors: int, config_name: str = "canary_qwen_2_5b",
             family: str | None = None):
    """The plan of conf/``config_name``.yaml (trained as ``family``, when given) on ``target`` at ``anchors`` anchors
    over ``ranks`` ranks of ``gpu``."""
    from dflash_train.config import validate_config
    from dflash_train.config.compose import compose_config
    from dflash_train.plan import plan_run

    cuts = work / "cuts.jsonl"
    cuts.write_text('{"id": "utt-1"}\n')
    repo = Path(__file__).resolve().parent.parent
    cfg = compose_config(config_name, [
        f"model.pretrained_name={target}", 'model.audio_locator_tag="<|audio|>"',  # the tiny tokenizer's tag
        f"data.train_ds.input_cfg.0.cuts_path={cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={cuts}", f"exp_manager.explicit_log_dir={work / 'run'}",
        f"dflash.num_anchors={anchors}", f"trainer.devices={min(ranks, 8)}", f"trainer.num_nodes={max(1, ranks // 8)}",
        *family_overrides(family),
    ], repo / "conf")
    return plan_run(validate_config(cfg), gpu, ranks)


def main(argv: list[str] | None = None) -> int:
    """Plan every cell and print the Markdown table's rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--out", type=Path, default=None, help="where the shaped checkpoints go (default: a temp dir)")
    parser.add_argument("--anchors", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--gpus", nargs="+", default=["h100", "h200"])
    parser.add_argument("--families", nargs="+", default=[None], choices=["dflash", "dflash2", "eagle3", "mtp"],
                        help="draft families to plan (default: each run config's own; mtp needs a target with an "
                             "MTP block: lightning)")
    parser.add_argument("--json", type=Path, default=None, help="write every plan here")
    args = parser.parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="plan_table_"))
    plans = []
    print("| target | GPU | ranks | anchors | peak GiB/rank (counted + allowance) | fits | step ≥ ms | MFU ≤ | tokens/s ≤ "
          "| plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in args.targets:
        label, config_name, build = TARGETS[key]
        target = build(work / f"{key}_shaped")
        for family, gpu, ranks, anchors in itertools.product(args.families, args.gpus, args.ranks, args.anchors):
            started = time.perf_counter()
            plan = plan_row(target, work, gpu, ranks, anchors, config_name, family)
            seconds = time.perf_counter() - started
            name = label if family is None else f"{label}, {plan.variant}"
            plans.append(plan.to_json() | {"target": name, "plan_seconds": seconds})
            print(f"| {name} | {gpu.upper()} | {ranks} | {anchors} | "
                  f"{plan.peak_bytes / 2**30:.1f} + {plan.allowance_bytes / 2**30:.1f} | "
                  f"{'yes' if plan.fits else 'no'} | {plan.step_seconds * 1e3:.0f} | {plan.mfu:.0%} | "
                  f"{plan.tokens_per_second:,.0f} | {seconds:.0f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(plans, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
