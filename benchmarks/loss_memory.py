"""Peak memory of a training step: the chunked LM head + cross-entropy vs the full-logits loss.

    .venv/bin/python benchmarks/loss_memory.py [--variant dflash2] [--out benchmarks/loss_memory.json]

The loss is what dominates a draft step's memory at a real vocabulary: ``[positions, V]`` logits in
FP32 plus cross-entropy's softmax and gradient of the same size. The step here is the real trainer core
of the variant (nemo_automodel's DFlash / DFlash2 core under our chunked mixin, or our MTP objective)
with the shipped recipe's shape (block 8, anchors as given) around a draft of tiny hidden size (64) and
the real vocabulary, fed random target features for one row long enough for every anchor count. Each
setting runs in a fresh subprocess, one after another in this one invocation: the figure is the peak
resident memory above the level just before the step (forward + backward), read from ``ru_maxrss``.
FP32 on CPU; on a GPU under bf16 autocast the logits are still FP32 at the loss, so the ratio carries.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, BLOCK = 64, (1, 3), 8
VOCABS = (32_000, 151_936)
ANCHORS = (128, 256, 512, 1024)


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def probe(variant: str, vocab: int, anchors: int, chunk: int) -> dict:
    """Subprocess body: one training step's peak memory above the pre-step level, and its time."""
    from transformers import Qwen3Config

    from dflash_train.draft import DraftSpec
    from dflash_train.draft.family import family_of
    from dflash_train.variants import variant_named

    torch.manual_seed(0)
    llm = Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    schema = variant_named(variant).config_schema
    extra = {"selector_rank": 32} if variant == "dflash2" else {}
    cfg = schema(variant=variant, block_size=BLOCK, num_anchors=anchors, draft_num_hidden_layers=1,
                 loss_chunk_size=chunk, **extra)
    spec = DraftSpec(cfg, LAYERS if variant != "mtp" else (), vocab - 1, 4)

    class Target:  # what a trainer core reads of the frozen target
        llm_config = llm
        lm_head = torch.nn.Linear(HIDDEN, vocab, bias=False).requires_grad_(False)
        embed_tokens = torch.nn.Embedding(vocab, HIDDEN).requires_grad_(False)

    family = family_of(spec.variant)
    core = family.build_core(family.build_draft(Target, spec, "sdpa"), Target, spec, "sdpa", False)
    length = anchors + 2 * BLOCK + 64
    ids = torch.randint(0, vocab - 1, (1, length))
    loss_mask = torch.ones(1, length)
    doc_remaining = torch.arange(length - 1, -1, -1)[None]
    if variant == "mtp":
        inputs = dict(features=torch.randn(1, length, HIDDEN), embeds=Target.embed_tokens(ids))
    else:
        inputs = dict(hidden_states=torch.randn(1, length, len(LAYERS) * HIDDEN))
    before = _resident_mib()
    start = time.perf_counter()
    metrics = core(ids, loss_mask=loss_mask, doc_remaining=doc_remaining, **inputs)
    metrics.loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"variant": variant, "vocab": vocab, "anchors": anchors, "chunk": chunk, "positions": int(metrics.valid_tokens),
            "peak_mib": round(peak, 1), "step_s": round(seconds, 3), "loss": float(metrics.loss)}


def _run(variant: str, vocab: int, anchors: int, chunk: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--probe", variant, str(vocab), str(anchors), str(chunk)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="dflash2", choices=["dflash", "dflash2", "mtp"])
    parser.add_argument("--chunk", type=int, default=256, help="dflash.loss_chunk_size of the chunked rows")
    parser.add_argument("--full-max-anchors", type=int, default=512,
                        help="largest anchor count the full-logits loss is run at (it needs ~20 GB at 1024)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "loss_memory.json")
    parser.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        variant, vocab, anchors, chunk = args.probe
        print(json.dumps(probe(variant, int(vocab), int(anchors), int(chunk))))
        return 0
    rows = []
    print(f"{args.variant}, block {BLOCK}, hidden {HIDDEN}, one row; peak resident memory above the pre-step level")
    print(f"{'V':>8} {'anchors':>8} {'full MiB':>10} {'chunked MiB':>12} {'ratio':>7} {'full s':>7} {'chunked s':>10}")
    for vocab in VOCABS:
        for anchors in ANCHORS:
            chunked = _run(args.variant, vocab, anchors, args.chunk)
            full = _run(args.variant, vocab, anchors, 0) if anchors <= args.full_max_anchors else None
            rows += [r for r in (full, chunked) if r]
            if full:
                assert abs(full["loss"] - chunked["loss"]) <= 1e-4 * abs(full["loss"]), (full, chunked)
            ratio = f"{full['peak_mib'] / chunked['peak_mib']:7.1f}" if full else "      -"
            print(f"{vocab:8d} {anchors:8d} {full['peak_mib'] if full else '-':>10} {chunked['peak_mib']:12.1f} "
                  f"{ratio} {full['step_s'] if full else '-':>7} {chunked['step_s']:10.2f}", flush=True)
    args.out.write_text(json.dumps({"variant": args.variant, "hidden": HIDDEN, "block": BLOCK, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
