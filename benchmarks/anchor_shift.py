"""Diagnosis of the train/serve gap: teacher-forced acceptance over all anchors vs over serving's round starts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/anchor_shift.py --draft dflash=DIR --draft dflash2=DIR [--limit 0]

For every held-out utterance of the reference corpus the reference decoder runs each draft like
serving; then the draft proposes at every anchor of the target's greedy reply (context: the reply
before it; labels: the reply after it), which is what serving would accept at a round starting
there (``dflash_train.evaluate.anchors``). The table splits the anchors by kind: serving's round
starts (first round, after a round whose proposals were all accepted, right after the target
corrected the draft) and the anchors serving never starts a round at. If serving's rounds start
at harder anchors than the average one, the gap between teacher-forced and serving acceptance is
a shift of the anchor distribution, as issue 17 supposes.

Writes ``anchor_shift.json`` into ``--work`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_reference_target import OUT as TARGET_DIR  # noqa: E402
from train_reference_target import WORK, corpus  # noqa: E402

from dflash_train.evaluate.anchors import AFTER_CORRECTION, AFTER_FULL, FIRST, KINDS, NOT_A_START  # noqa: E402

ROWS = {
    "all anchors (teacher forcing)": KINDS,
    "serving's round starts": (FIRST, AFTER_FULL, AFTER_CORRECTION),
    "  first round": (FIRST,),
    "  after a full round": (AFTER_FULL,),
    "  after a correction": (AFTER_CORRECTION,),
    "not a round start": (NOT_A_START,),
}


def profile_drafts(target: Path, drafts: dict[str, str], test: Path, limit: int | None, max_new_tokens: int) -> dict:
    """Anchor tables of every draft on the same held-out requests."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.anchors import AnchorTable, anchor_profile
    from dflash_train.evaluate.decoder import StopRule
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.requests import RequestFailure, prompt_embeddings, read_requests
    from dflash_train.evaluate.run import prepare

    results = {}
    for name, export in drafts.items():
        settings, loaded = prepare(TargetSource(checkpoint=str(target)), {name: export},
                                   InputConfig(type="lhotse_as_conversation", cuts_path=str(test)),
                                   max_new_tokens=max_new_tokens, limit=limit)
        context, k = loaded.context, settings.num_speculative_tokens
        rule = StopRule(max_new_tokens, frozenset(settings.stop_token_ids))
        started, profiles, inconsistent = time.perf_counter(), [], 0
        for request in read_requests(settings.data, context.prompt_format, context.estimator, limit=limit):
            if isinstance(request, RequestFailure):
                raise RuntimeError(f"{request.id}: {request.error}")
            embeds = prompt_embeddings(context.target, request.prompt)
            profile = anchor_profile(context.target, loaded.drafts[name], embeds, rule, k)
            inconsistent += not profile.consistent()
            profiles.append(profile)
        table = AnchorTable.of(profiles, k)
        rows = {}
        for label, kinds in ROWS.items():
            n, mean, rates = table.row(kinds)
            rows[label] = {"anchors": n, "accept_len": mean, "acceptance": rates}
        results[name] = {"K": k, "requests": len(profiles), "inconsistent_requests": inconsistent,
                         "wall_s": round(time.perf_counter() - started, 1), "rows": rows,
                         "training_info": _training_info(export)}
    return results


def _training_info(export: str) -> dict:
    config = json.loads((Path(export) / "config.json").read_text())
    info = config.get("training_info") or {}
    return {key: info.get(key) for key in ("global_step", "val_accept_len", "val_serving_mal")}


def table(results: dict) -> list[str]:
    lines = []
    for name, result in results.items():
        k = result["K"]
        lines += [f"**{name}** (K = {k}, {result['requests']} held-out requests, training's teacher-forced "
                  f"val accept_len {result['training_info']['val_accept_len']})", "",
                  "| anchors | count | accepted length | " + " ".join(f"@{i}" for i in range(1, k + 1)) + " |",
                  "|---|---|---|---|"]
        for label, row in result["rows"].items():
            rates = " ".join(f"{r:.2f}" for r in row["acceptance"])
            lines.append(f"| {label.strip()} | {row['anchors']} | {row['accept_len']:.2f} | {rates} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(TARGET_DIR))
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=DIR",
                        help="a draft export to profile (repeat for several)")
    parser.add_argument("--limit", type=int, default=0, help="held-out utterances (default: all 100)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--work", default=str(WORK / "anchor_shift"))
    args = parser.parse_args(argv)
    drafts = dict(item.split("=", 1) for item in args.draft)
    _, test = corpus()
    results = profile_drafts(Path(args.target), drafts, test, args.limit or None, args.max_new_tokens)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "anchor_shift.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(table(results)))
    return 0 if all(r["inconsistent_requests"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
