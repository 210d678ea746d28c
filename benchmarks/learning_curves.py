"""Learning curves on the reference targets: serving MAL, acceptance@1 and MAL after a correction against step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_curves.py --target salm --variant dflash --seed 42
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_curves.py --variant dflash2 --seed 45 \
        --override dflash.selector_rank=256          # an experiment row: the recipe's selector, not the benchmark's
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_curves.py --variant dflash2 --seed 45 \
        --override dflash.conv_kernel_size=1         # DFlash2 without its in-block convolution (no plateau)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learning_curves.py --report

Issue 49: is the step serving prefers the last one, and does the step validation prefers (``val/serving_mal``,
what ``exp_manager.export_checkpoint=best`` exports) serve better on held-out data than the last step? The
benchmark runs in parts, each within about an hour on 2 cores: one part trains one family (``dflash``,
``dflash2``, ``mtp``, ``eagle3``) on one reference target (``salm``: ``benchmarks/reference_target``; ``nemotron_h``:
``benchmarks/reference_target_nemotron_h``) with one seed, as ``benchmarks/acceptance.py`` trains its rows
(``conf/demo.yaml``, offline labels, the same scaled-down recipe; its functions, not copies).

1. The target's offline labels of the training subset, of a validation slice after it and of the held-out
   test utterances (once per target).
2. ``--steps`` in launches of ``--every`` steps: each launch continues the last from its checkpoint (exact
   resume; the learning rate is constant, so the curve is the uninterrupted run's), validates at its end with
   serving validation on (``val/serving_mal``, what a monitored checkpoint is chosen by, on labelled training
   utterances held out of training, not the test's) and writes its export, kept as ``exports/step-N``.
3. Every kept export through the reference decoder on the held-out utterances (DFlash / DFlash2 and EAGLE-3
   drafts in one pass at the K they serve with: block_size - 1, ttt_steps; each MTP export at K = D): pooled serving MAL, acceptance@1 and the MAL of the rounds
   right after a correction, at every step.

A part writes ``benchmarks/.work/learning_curves/<target>/<variant>-s<seed>/curve.json`` (an interrupted part
continues from its kept steps). ``--report`` reads every finished part and prints, per target and family, the
figures against step (mean ± sd over the seeds), and what exporting the last step and the best step by
``val/serving_mal`` give on held-out data; it writes ``results.json`` and ``curves.png`` beside the parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from acceptance import first_cuts, served_figures, summary, evaluate_drafts, offline_labels, train_variant  # noqa: E402
from train_reference_target import WORK, corpus  # noqa: E402

from dflash_train.evaluate.run import MTP, TARGET_MTP_HEADS  # noqa: E402

TARGETS = {"salm": ROOT / "benchmarks" / "reference_target",
           "nemotron_h": ROOT / "benchmarks" / "reference_target_nemotron_h"}
FAMILIES = ("dflash", "dflash2", "mtp", "eagle3")
OUT = WORK / "learning_curves"
CURVE_FILE = "curve.json"
LABEL_LIMIT = 1200  # training utterances of a part by default (--label-limit: another size is an experiment row)
FIGURES = (("mal", "serving MAL"), ("acceptance_at_1", "acceptance@1"), ("after_correction_mal", "MAL after a correction"))


def labelled_data(target: Path, work: Path, label_limit: int, val_limit: int, eval_limit: int,
                  max_new_tokens: int) -> tuple[Path, Path, Path]:
    """The target's offline labels, written once per target: ``(train, validation, test)``. Training: the first
    ``label_limit`` training utterances; validation: the next ``val_limit`` (what ``val/serving_mal`` and a
    monitored checkpoint choose by, apart from the test); test: the held-out utterances (``eval_limit``: the
    first that many; 0: all)."""
    files = tuple(work / f"{split}_labels.jsonl.gz" for split in ("train", "val", "test"))
    if all(f.exists() for f in files):
        return files
    work.mkdir(parents=True, exist_ok=True)
    train_cuts, test_cuts = corpus()
    sources = (first_cuts(train_cuts, work / "train_subset.jsonl.gz", label_limit),
               first_cuts(train_cuts, work / "val_subset.jsonl.gz", val_limit, skip=label_limit),
               test_cuts if not eval_limit else first_cuts(test_cuts, work / "test_subset.jsonl.gz", eval_limit))
    for source, labels in zip(sources, files):
        offline_labels(target, source, labels, max_new_tokens)
    return files


def train_part(target: Path, variant: str, seed: int, steps: int, every: int, train: Path, val: Path,
               part: Path, overrides: tuple[str, ...] = ()) -> list[dict]:
    """Train to ``steps`` in launches of ``every`` steps, keeping each launch's export and validation figures;
    steps kept by an earlier, interrupted call are not trained again."""
    run_dir, points = part / "run", []
    for step in range(every, steps + 1, every):
        kept = part / "exports" / f"step-{step}"
        record = kept.with_suffix(".json")
        if record.exists():
            points.append(json.loads(record.read_text()))
            continue
        row = train_variant(target, f"curve-{variant}", variant, "ground_truth", train, val, run_dir, step, seed,
                            extra=overrides, fresh=step == every)
        if kept.exists():
            shutil.rmtree(kept)
        shutil.copytree(row["export"], kept)  # an MTP export links the target's files: copied as files
        point = {"step": step, "export": str(kept), "train_wall_s": row["train_wall_s"], "trained_k": row["trained_k"],
                 "val_serving_mal": row["val_serving_mal"], "val_accept_len": row["val_accept_len"]}
        record.write_text(json.dumps(point, indent=2) + "\n")
        points.append(point)
    return points


def evaluate_part(target: Path, variant: str, points: list[dict], test: Path, max_new_tokens: int, part: Path) -> None:
    """Every kept export through the reference decoder on the held-out utterances; adds the serving figures
    (acceptance.py's) and ``acceptance_at_1`` to each point."""
    if variant != "mtp":
        names = {f"step-{p['step']}": p["export"] for p in points}
        report = evaluate_drafts(target, names, test, None, max_new_tokens, part / "eval.json")
        for point in points:
            served_figures(point, report, f"step-{point['step']}")
    for point in points if variant == "mtp" else ():
        report = evaluate_drafts(Path(point["export"]), {MTP: TARGET_MTP_HEADS}, test, None, max_new_tokens,
                                 part / f"eval-step-{point['step']}.json", num_speculative_tokens=point["trained_k"])
        served_figures(point, report, MTP)
    for point in points:
        point["acceptance_at_1"] = point["per_position"][0]["acceptance"]


def part_name(variant: str, seed: int, overrides: tuple[str, ...]) -> str:
    """A part's directory: the family, the seed and the experiment's overrides (``dflash.selector_rank=256`` →
    ``dflash2-s45-selector_rank-256``: no "=" in a path Hydra reads)."""
    tags = (o.removeprefix("dflash.").replace("=", "-").replace("/", "_") for o in overrides)
    return "-".join([variant, f"s{seed}", *tags])


@contextmanager
def proposing_by(proposal: str) -> Iterator[None]:
    """DFlash2's serving proposal while the block runs: ``walk`` (its candidate walk, what vLLM serves) or
    ``argmax`` (each position's base-head argmax, DFlash's proposal, from the same exports): the experiment that
    tells a walk that loses acceptance from a head that does."""
    from dflash_train.variants import variant_named
    from dflash_train.variants.base import DraftVariant

    dflash2 = type(variant_named("dflash2"))
    saved = dflash2.__dict__["propose"]
    if proposal == "argmax":
        dflash2.propose = DraftVariant.propose
    try:
        yield
    finally:
        dflash2.propose = saved


def run_part(target_name: str, variant: str, seed: int, steps: int, every: int, label_limit: int, val_limit: int,
             eval_limit: int, max_new_tokens: int, overrides: tuple[str, ...] = (), proposal: str = "walk") -> dict:
    """One part: labels (once per target), training in launches, evaluation; writes and returns ``curve.json``.
    ``overrides`` (Hydra, after the benchmark's own) make it an experiment row, reported apart from the family;
    so does ``proposal="argmax"`` (DFlash2: the same exports evaluated by :func:`proposing_by` argmax, in a part
    of its own beside the trained one)."""
    started = time.perf_counter()
    target = TARGETS[target_name]
    if not (target / "model.safetensors").exists():
        raise SystemExit(f"no reference target in {target}: run benchmarks/train_reference_target.py")
    # another training-set size is another labelled set, kept apart (more data vs more steps)
    work = OUT / (target_name if label_limit == LABEL_LIMIT else f"{target_name}-{label_limit}utt")
    train, val, test = labelled_data(target, work, label_limit, val_limit, eval_limit, max_new_tokens)
    trained = work / part_name(variant, seed, overrides)
    points = train_part(target, variant, seed, steps, every, train, val, trained, overrides)
    part = trained if proposal == "walk" else trained.with_name(f"{trained.name}-{proposal}")
    part.mkdir(parents=True, exist_ok=True)
    with proposing_by(proposal):
        evaluate_part(target, variant, points, test, max_new_tokens, part)
    experiment = list(overrides) + ([f"proposal={proposal}"] if proposal != "walk" else [])
    curve = {"target": target_name, "variant": variant, "overrides": experiment, "seed": seed, "steps": steps,
             "every": every,
             "label_limit": label_limit, "val_limit": val_limit, "eval_limit": eval_limit, "max_new_tokens": max_new_tokens,
             "wall_s": round(time.perf_counter() - started, 1), "points": points}
    (part / CURVE_FILE).write_text(json.dumps(curve, indent=2) + "\n")
    return curve


def choices(points: list[dict]) -> dict:
    """What each export choice gives on held-out data: the last step, the best step by ``val/serving_mal``
    (the earliest of equals, as the monitored checkpoint keeps it) and the best step by held-out MAL."""
    by_val = max(points, key=lambda p: (p["val_serving_mal"] if p["val_serving_mal"] is not None else -math.inf,
                                        -p["step"]))
    by_mal = max(points, key=lambda p: (p["mal"], -p["step"]))
    return {"last": points[-1], "best_by_val_serving_mal": by_val, "best_by_held_out_mal": by_mal}


def collect(out: Path) -> dict[tuple[str, str], list[dict]]:
    """Every finished part under ``out``, by (target, family)."""
    parts: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(out.glob(f"*/*/{CURVE_FILE}")):
        curve = json.loads(path.read_text())
        sized = [f"{curve['label_limit']}utt"] if curve["label_limit"] != LABEL_LIMIT else []
        label = " ".join([curve["variant"], *curve.get("overrides", []), *sized])  # an experiment is its own row
        parts.setdefault((curve["target"], label), []).append(curve)
    return parts


def _pm(values: list) -> str:
    stats = summary(values)
    return "n/a" if stats["mean"] is None else f"{stats['mean']:.2f} ± {stats['sd']:.2f}"


def table(parts: dict[tuple[str, str], list[dict]]) -> list[str]:
    """The figures against step, then the export choices, per target and family (mean ± sd over the seeds)."""
    lines = ["| target | family | step | seeds | serving MAL | acceptance@1 | MAL after a correction "
             "| val serving MAL (training) |", "|" + "---|" * 8]
    for (target, variant), curves in sorted(parts.items()):
        steps = sorted({p["step"] for c in curves for p in c["points"]})
        for step in steps:
            at = [p for c in curves for p in c["points"] if p["step"] == step]
            lines.append(f"| {target} | {variant} | {step} | {len(at)} | " + " | ".join(
                _pm([p[key] for p in at]) for key in ("mal", "acceptance_at_1", "after_correction_mal",
                                                      "val_serving_mal")) + " |")
    lines += ["", "| target | family | seeds | export | step chosen (per seed) | held-out serving MAL | vs last |",
              "|" + "---|" * 7]
    for (target, variant), curves in sorted(parts.items()):
        chosen = [choices(c["points"]) for c in curves]
        for name in ("last", "best_by_val_serving_mal", "best_by_held_out_mal"):
            gains = [c[name]["mal"] - c["last"]["mal"] for c in chosen]
            lines.append(f"| {target} | {variant} | {len(curves)} | {name} | "
                         + ", ".join(str(c[name]["step"]) for c in chosen)
                         + f" | {_pm([c[name]['mal'] for c in chosen])} | {_pm(gains)} |")
    return lines


def plot(parts: dict[tuple[str, str], list[dict]], path: Path) -> Path:
    """One row per target, one panel per figure, one line per family (mean over seeds, ± sd shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({t for t, _ in parts})
    fig, axes = plt.subplots(len(targets), len(FIGURES), figsize=(5 * len(FIGURES), 3.5 * len(targets)),
                             squeeze=False)
    for row, target in enumerate(targets):
        for col, (key, title) in enumerate(FIGURES):
            ax = axes[row][col]
            for (t, variant), curves in sorted(parts.items()):
                if t != target:
                    continue
                steps = sorted({p["step"] for c in curves for p in c["points"]})
                stats = [summary([p[key] for c in curves for p in c["points"] if p["step"] == s]) for s in steps]
                mean = [s["mean"] for s in stats]
                ax.plot(steps, mean, marker="o", label=f"{variant} ({len(curves)} seeds)")
                ax.fill_between(steps, [m - s["sd"] for m, s in zip(mean, stats)],
                                [m + s["sd"] for m, s in zip(mean, stats)], alpha=0.2)
            ax.set_title(f"{target}: {title}")
            ax.set_xlabel("step")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(out: Path) -> list[str]:
    """The table of every finished part under ``out``; writes ``results.json`` and ``curves.png`` there."""
    parts = collect(out)
    if not parts:
        raise SystemExit(f"no finished part under {out}: run a part first (--target, --variant, --seed)")
    lines = table(parts)
    (out / "results.json").write_text(json.dumps(
        {f"{t}/{v}": {"curves": curves, "choices": [
            {name: point["step"] for name, point in choices(c["points"]).items()} for c in curves]}
         for (t, v), curves in parts.items()}, indent=2) + "\n")
    lines.append(f"\nplot: {plot(parts, out / 'curves.png')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=list(TARGETS), default="salm")
    parser.add_argument("--variant", choices=FAMILIES, default="dflash")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--steps", type=int, default=2400, help="training steps of a part (default %(default)s)")
    parser.add_argument("--every", type=int, default=300,
                        help="steps between validations and kept exports (default %(default)s)")
    parser.add_argument("--label-limit", type=int, default=LABEL_LIMIT,
                        help="training utterances labelled and trained on (default %(default)s; once per target)")
    parser.add_argument("--val-limit", type=int, default=32,
                        help="training utterances after those trained on, labelled for validation (default "
                             "%(default)s; once per target)")
    parser.add_argument("--eval-limit", type=int, default=0,
                        help="held-out utterances evaluated (default %(default)s: all 100; once per target)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override after the benchmark's own (repeatable): an experiment row, e.g. "
                             "dflash.selector_rank=256 (the recipe's) against the benchmark's 32")
    parser.add_argument("--proposal", choices=("walk", "argmax"), default="walk",
                        help="DFlash2's serving proposal: its candidate walk (default), or the base head's argmax "
                             "evaluated on the same exports (an experiment row)")
    parser.add_argument("--report", action="store_true", help="no training: the table and plot of finished parts")
    args = parser.parse_args(argv)
    if args.proposal != "walk" and args.variant != "dflash2":
        parser.error("--proposal argmax is DFlash2's experiment (the other families propose by argmax already)")
    logging.basicConfig(level=logging.WARNING)
    if args.steps % args.every:
        parser.error(f"--steps {args.steps} is not a multiple of --every {args.every}")
    if not args.report:
        curve = run_part(args.target, args.variant, args.seed, args.steps, args.every, args.label_limit,
                         args.val_limit, args.eval_limit, args.max_new_tokens, tuple(args.override), args.proposal)
        print(f"part {args.target}/{args.variant}/seed {args.seed}: {curve['wall_s'] / 60:.1f} min")
    print("\n".join(report(OUT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
