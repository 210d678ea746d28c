"""The predicted table of docs/benchmarks.md ("Predicted fit and step bound: dflash-plan"): the shipped
recipe on a canary-qwen-2.5b-shaped SALM, planned by :func:`dflash_train.plan.plan_run` on H100 and H200
at 128 / 512 / 1024 anchors and 8 / 64 ranks. Nothing runs on a GPU and no weight exists: the target
is the tiny SALM's checkpoint (dflash_train/testing/tiny_salm.py) with its config files scaled to the
public model's shapes and its weights file removed.

    python benchmarks/plan_table.py [--out DIR] [--anchors 128 512 1024] [--ranks 8 64] [--gpus h100 h200]

Prints the Markdown rows (and ``--json FILE`` writes every plan).
"""

from __future__ import annotations

import argparse
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
    config_file = target / "config.json"
    config = json.loads(config_file.read_text())
    perception = config["perception"]
    perception["encoder"].update(CANARY_ENCODER)
    perception["preprocessor"]["features"] = CANARY_ENCODER["feat_in"]
    perception["modality_adapter"].update(d_model=CANARY_ENCODER["d_model"], feat_in=CANARY_ENCODER["d_model"],
                                          n_heads=8, n_layers=2)
    perception["output_dim"] = CANARY_QWEN_LLM["hidden_size"]
    config_file.write_text(json.dumps(config, indent=2))
    return target


def plan_row(target: Path, work: Path, gpu: str, ranks: int, anchors: int):
    """The plan of conf/canary_qwen_2_5b.yaml on ``target`` at ``anchors`` anchors over ``ranks`` ranks of ``gpu``."""
    from dflash_train.config import validate_config
    from dflash_train.config.compose import compose_config
    from dflash_train.plan import plan_run

    cuts = work / "cuts.jsonl"
    cuts.write_text('{"id": "utt-1"}\n')
    repo = Path(__file__).resolve().parent.parent
    cfg = compose_config("canary_qwen_2_5b", [
        f"model.pretrained_name={target}", 'model.audio_locator_tag="<|audio|>"',  # the tiny tokenizer's tag
        f"data.train_ds.input_cfg.0.cuts_path={cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={cuts}", f"exp_manager.explicit_log_dir={work / 'run'}",
        f"dflash.num_anchors={anchors}", f"trainer.devices={min(ranks, 8)}", f"trainer.num_nodes={max(1, ranks // 8)}",
    ], repo / "conf")
    return plan_run(validate_config(cfg), gpu, ranks)


def main(argv: list[str] | None = None) -> int:
    """Plan every cell and print the Markdown table's rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the shaped checkpoint goes (default: a temp dir)")
    parser.add_argument("--anchors", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--gpus", nargs="+", default=["h100", "h200"])
    parser.add_argument("--json", type=Path, default=None, help="write every plan here")
    args = parser.parse_args(argv)
    work = args.out or Path(tempfile.mkdtemp(prefix="plan_table_"))
    target = canary_qwen_shaped(work / "canary_qwen_shaped")
    plans = []
    print("| target | GPU | ranks | anchors | peak GiB/rank (counted + allowance) | fits | step ≥ ms | MFU ≤ | tokens/s ≤ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpu in args.gpus:
        for ranks in args.ranks:
            for anchors in args.anchors:
                started = time.perf_counter()
                plan = plan_row(target, work, gpu, ranks, anchors)
                plans.append(plan.to_json() | {"plan_seconds": time.perf_counter() - started})
                print(f"| canary-qwen-2.5b (shaped) | {gpu.upper()} | {ranks} | {anchors} | "
                      f"{plan.peak_bytes / 2**30:.1f} + {plan.allowance_bytes / 2**30:.1f} | "
                      f"{'yes' if plan.fits else 'no'} | {plan.step_seconds * 1e3:.0f} | {plan.mfu:.0%} | "
                      f"{plan.tokens_per_second:,.0f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(plans, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
