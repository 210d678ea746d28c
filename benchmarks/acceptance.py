"""Acceptance benchmark on a reference target: serving MAL of drafts trained alike, over seeds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/acceptance.py [--steps 600] [--seeds 42 43 44] [--variants ...]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/acceptance.py --target benchmarks/reference_target_nemotron_h \\
        --variants dflash dflash2 mtp

Needs a stored target (``benchmarks/reference_target``, NeMo's SALM with a Qwen3 LLM, or
``benchmarks/reference_target_nemotron_h``, a SpeechLM with a Nemotron-H LLM of Mamba-2, attention and MoE
blocks) and the synthesized corpus (``benchmarks/train_reference_target.py [--backbone nemotron_h]`` builds
both; the corpus alone is rebuilt here when missing). Everything it writes goes to
``benchmarks/.work/acceptance`` (``acceptance-<target directory>`` for another target; git-ignored).

1. Offline labels (the ``dflash-labels`` workflow): the target's greedy transcripts of the first
   ``--label-limit`` training utterances and of the held-out test utterances.
2. Every row of ``--variants`` trained once per seed on one budget (``conf/demo.yaml`` with overrides,
   i.e. the demo's code path and its scaled-down recipe: 2 draft layers, B=8, gamma 4, 32 anchors,
   AdamW 2e-3), identical data, labels, steps and K; a row differs from its baseline only in the
   overrides named in ``VARIANTS`` (``dflash+kl``: KL distillation instead of cross-entropy,
   ``dflash+kl_tv``: KL + TV, ``dflash2-target_argmax``: the original transcripts with
   ``label_source=target_argmax``, ...); MTP rows train heads (``dflash=mtp``, D = 3 steps); ``eagle3``
   trains an EAGLE-3 draft (``dflash=eagle3``, ttt_steps 7, the recipe's draft vocabulary).
3. All DFlash / DFlash2 / EAGLE-3 drafts of every seed through the reference speculative decoder on the same
   held-out utterances in one pass at K = block_size - 1 = ttt_steps (pooled MAL, per-position acceptance, greedy
   equivalence, WER); each MTP export (the target with its trained heads) at K = D and K = 2D.
4. Per row: serving MAL, its fraction of the ceiling (a draft that is always right on these
   replies), first-position acceptance, MAL of the rounds right after a correction, teacher-forced
   accept_len and serving / teacher-forced as mean ± sd over the seeds (every seed's figure kept); a row ``NAME+METHOD``
   "wins" against row ``NAME`` only when its mean MAL is higher by more than two standard errors of
   the difference.

Prints one table and writes ``results.json`` (and the full ``eval.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_reference_target import OUT as TARGET_DIR  # noqa: E402
from train_reference_target import WORK, corpus  # noqa: E402

from dflash_train.evaluate.anchors import AFTER_CORRECTION, round_starts  # noqa: E402
from dflash_train.evaluate.run import MTP, TARGET_MTP_HEADS  # noqa: E402
from dflash_train.variants import variant_named  # noqa: E402

DFLASH2_SELECTOR_RANK = 32  # scaled down with the draft (recipe default 256)
MTP_STEPS = 3  # D, the trained MTP steps (NeMo's SpeechLM MTP checkpoints train 1-3)

SERVING_ANCHORS = ("dflash.serving_anchor_fraction=0.5", "dflash.serving_anchor_every=10")
KL = ("dflash.loss_ce_weight=0", "dflash.loss_kl_weight=1")  # distillation alone (docs/training.md, Choose the loss)
KL_TV = KL + ("dflash.loss_tv_weight=1",)
CE_KL = ("dflash.loss_ce_weight=0.5", "dflash.loss_kl_weight=0.5")
# the on-policy stage over the last third of the default 600 steps, mining each batch every other step
ON_POLICY = ("dflash.on_policy_from_step=400", "dflash.serving_anchor_every=2")
ON_POLICY_FULL = ON_POLICY + ("dflash.on_policy_after_rejection_weight=1",)  # the ordinary loss after a rejection
ON_POLICY_ANCHORS = ON_POLICY_FULL + ("dflash.on_policy_reverse_kl_weight=0",)  # only the blocks move: the ordinary loss

# tap choices on the SALM reference target (6 LLM blocks; the 2-layer draft's derived taps are [1, 3]), docs/target.md
TAPS_SHALLOW = ("dflash.target_layer_ids=[0,1]",)
TAPS_DEEP = ("dflash.target_layer_ids=[4,5]",)
TAPS_ONE = ("dflash.target_layer_ids=[3]",)
TAPS_ALL = ("dflash.target_layer_ids=[0,1,2,3,4,5]",)

# name -> (draft variant, training data, label_source, extra recipe overrides)
VARIANTS = {
    "dflash": ("dflash", "offline", "ground_truth", ()),
    "dflash2": ("dflash2", "offline", "ground_truth", ()),
    "dflash+serving_anchors": ("dflash", "offline", "ground_truth", SERVING_ANCHORS),
    "dflash2+serving_anchors": ("dflash2", "offline", "ground_truth", SERVING_ANCHORS),
    "dflash2-target_argmax": ("dflash2", "original", "target_argmax", ()),
    "dflash2-ground_truth": ("dflash2", "original", "ground_truth", ()),
    "mtp": ("mtp", "offline", "ground_truth", ()),
    "eagle3": ("eagle3", "offline", "ground_truth", ()),
    "dflash+kl": ("dflash", "offline", "ground_truth", KL),
    "dflash+kl_tv": ("dflash", "offline", "ground_truth", KL_TV),
    "dflash+ce_kl": ("dflash", "offline", "ground_truth", CE_KL),
    "dflash2+kl": ("dflash2", "offline", "ground_truth", KL),
    "dflash2+kl_tv": ("dflash2", "offline", "ground_truth", KL_TV),
    "mtp+kl": ("mtp", "offline", "ground_truth", KL),
    "dflash+on_policy": ("dflash", "offline", "ground_truth", ON_POLICY),
    "dflash2+on_policy": ("dflash2", "offline", "ground_truth", ON_POLICY),
    "dflash+on_policy_full": ("dflash", "offline", "ground_truth", ON_POLICY_FULL),
    "dflash2+on_policy_full": ("dflash2", "offline", "ground_truth", ON_POLICY_FULL),
    "dflash2+on_policy_anchors": ("dflash2", "offline", "ground_truth", ON_POLICY_ANCHORS),
    "dflash2+taps_shallow": ("dflash2", "offline", "ground_truth", TAPS_SHALLOW),
    "dflash2+taps_deep": ("dflash2", "offline", "ground_truth", TAPS_DEEP),
    "dflash2+taps_one": ("dflash2", "offline", "ground_truth", TAPS_ONE),
    "dflash2+taps_all": ("dflash2", "offline", "ground_truth", TAPS_ALL),
}
# the distillation comparison (docs/benchmarks.md): about an hour on 2 cores at 600 steps and 3 seeds
DEFAULT_VARIANTS = ["dflash", "dflash+kl", "dflash+kl_tv", "dflash2", "dflash2+kl_tv"]
WIN_STANDARD_ERRORS = 2.0  # a method wins when its mean beats its baseline's by more than this many SEs


def baseline_of(name: str, names) -> str | None:
    """The row a method row is compared with: the part of its name before ``+`` (``dflash+kl`` -> ``dflash``)."""
    base = name.split("+")[0]
    return base if base != name and base in names else None


def first_cuts(source: Path, dest: Path, count: int, skip: int = 0) -> Path:
    """The first ``count`` records of a cuts file after its first ``skip`` (the labelled training subset)."""
    import gzip
    from itertools import islice

    with gzip.open(source, "rt") as handle:
        lines = list(islice(handle, skip, skip + count))
    with gzip.open(dest, "wt") as handle:
        handle.writelines(lines)
    return dest


def labelled_data(target: Path, work: Path, label_limit: int, eval_limit: int | None, max_new_tokens: int,
                  cuts: tuple[Path, Path] | None = None, reuse: bool = False) -> tuple[Path, Path, Path, Path]:
    """The benchmark's data in ``work``: ``(training cuts, test cuts, training labels, test labels)``. The cuts
    are the first ``label_limit`` training utterances and the held-out ones (the first ``eval_limit``; none: all)
    of ``cuts`` (default: the reference corpus); the labels are ``target``'s greedy replies to them, made again
    unless ``reuse`` and both exist."""
    train_cuts, test_cuts = cuts if cuts is not None else corpus()
    work.mkdir(parents=True, exist_ok=True)
    subset = first_cuts(train_cuts, work / "train_subset.jsonl.gz", label_limit)
    test_subset = test_cuts if not eval_limit else first_cuts(test_cuts, work / "test_subset.jsonl.gz", eval_limit)
    train_labels, test_labels = work / "train_labels.jsonl.gz", work / "test_labels.jsonl.gz"
    if not (reuse and train_labels.exists() and test_labels.exists()):
        offline_labels(target, subset, train_labels, max_new_tokens)
        offline_labels(target, test_subset, test_labels, max_new_tokens)
    return subset, test_subset, train_labels, test_labels


def offline_labels(target: Path, cuts: Path, out: Path, max_new_tokens: int) -> Path:
    """``dflash-labels --target <reference target> --cuts <cuts> --out <out>``."""
    from dflash_train.cli.labels import main as labels_main

    rc = labels_main(["--target", str(target), "--cuts", str(cuts), "--out", str(out),
                      "--max-new-tokens", str(max_new_tokens)])
    if rc != 0:
        raise RuntimeError(f"dflash-labels exited with {rc} for {cuts}")
    return out


def train_variant(target: Path, name: str, variant: str, label_source: str, train: Path, val: Path, run_dir: Path,
                  steps: int, seed: int, extra: tuple[str, ...] = (), fresh: bool = True) -> dict:
    """Train one draft exactly as ``dflash-train --config-name=demo <overrides>`` would; ``fresh=False`` continues
    the run in ``run_dir`` from its last checkpoint (exact resume) up to ``steps``."""
    from omegaconf import open_dict

    from dflash_train.config import validate_config
    from dflash_train.config.compose import compose_config
    from dflash_train.training.recipe import train as run_training

    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [
        f"dflash={variant}",
        f"name=acceptance-{name}",
        f"seed={seed}",
        f"model.pretrained_name={target}",
        f"data.train_ds.input_cfg=[{{type:lhotse_as_conversation,cuts_path:'{train}'}}]",
        f"data.validation_ds.input_cfg=[{{type:lhotse_as_conversation,cuts_path:'{val}',name:test}}]",
        "data.train_ds.bucket_estimate_samples=200",
        f"dflash.label_source={label_source}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=4",
        f"exp_manager.explicit_log_dir={run_dir}",
        f"exp_manager.resume_if_exists={not fresh}",
        *extra,
    ]
    cfg = compose_config("demo", overrides)
    with open_dict(cfg):  # the selector size is pinned here so the benchmark does not follow demo.yaml edits
        if variant == "dflash2" and not any(o.startswith("dflash.selector_rank=") for o in extra):
            cfg.dflash.selector_rank = DFLASH2_SELECTOR_RANK
        else:
            cfg.dflash.pop("selector_rank", None)  # only DFlash2 has a selector
        if variant == "mtp":
            cfg.dflash.num_nextn_predict_layers = MTP_STEPS
    validated = validate_config(cfg)
    started = time.perf_counter()
    outcome = run_training(validated)
    wall = time.perf_counter() - started
    if outcome.export_dir is None:
        raise RuntimeError(f"{name}: training left no export")
    return {
        "variant": variant,
        "label_source": label_source,
        "steps": outcome.steps,
        "train_wall_s": round(wall, 1),
        "val_accept_len": outcome.val_accept_len,
        "val_serving_mal": outcome.val_serving_mal,
        "val_loss": outcome.val_loss,
        "overrides": list(extra),
        "export": str(outcome.export_dir),
        "trained_k": variant_named(variant).speculative_tokens(validated.run.dflash),
    }


def evaluate_drafts(target: Path, drafts: dict[str, str], test: Path, limit: int | None, max_new_tokens: int, out: Path,
                    num_speculative_tokens: int | None = None) -> dict:
    """All drafts through the reference decoder on identical samples, one pass (what ``dflash-eval`` runs);
    ``drafts`` may map a name to ``TARGET_MTP_HEADS`` (the target's own MTP heads, ``--mtp``)."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import evaluate, prepare

    settings, loaded = prepare(
        TargetSource(checkpoint=str(target)),
        drafts,
        InputConfig(type="lhotse_as_conversation", cuts_path=str(test)),
        num_speculative_tokens=num_speculative_tokens,
        max_new_tokens=max_new_tokens,
        limit=limit,
    )
    report = evaluate(settings, loaded)
    report.write_json(out)
    return report.to_dict()


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(results: dict) -> list[str]:
    """The benchmark table (markdown): each row's mean ± sd over the seeds, and its verdict against its baseline."""
    k, seeds = results["K"], results["seeds"]
    head = ("| variant | training labels | steps | seeds | train wall | teacher-forced val accept_len "
            "| serving MAL (mean ± sd) | per seed | MAL / ceiling | acceptance@1 | MAL after a correction "
            "| serving / teacher-forced | greedy equal | vs baseline |")
    lines = [head, "|" + "---|" * 14]
    for name, row in results["variants"].items():
        verdict = row.get("versus")
        versus = "—" if verdict is None else (
            f"{verdict['difference']:+.2f} ± {verdict['standard_error']:.2f} vs {verdict['baseline']}: "
            + ("**wins**" if verdict["wins"] else "no win"))
        lines.append(
            f"| {name} | {row['training_data']} | {row['steps']} | {len(row['per_seed'])} | "
            f"{row['train_wall_s']['mean']:.0f} s | {_pm(row['val_accept_len'])} | {_pm(row['mal'])} | "
            + " ".join(_fmt(v) for v in row["mal"]["values"]) + f" | {_pm(row['fraction_of_ceiling'])} of "
            f"{_fmt(row['ceiling'])} | {_pm(row['first_acceptance'])} | {_pm(row['after_correction_mal'])} | "
            f"{_pm(row['serving_over_teacher_forced'])} | {'yes' if row['greedy_equal'] else 'NO'} | {versus} |"
        )
    lines.append("")
    lines.append(
        f"Block drafts at K = {k}; seeds {', '.join(map(str, seeds))}; {results['samples_evaluated']} held-out "
        f"utterances, {results['rounds_note']}; target-only WER {100 * results['target_wer']:.1f} %; a method wins "
        f"when its mean serving MAL beats its baseline's by more than {WIN_STANDARD_ERRORS:g} standard errors of the "
        f"difference; total wall time {results['total_wall_s'] / 60:.1f} min."
    )
    return lines


def _pm(stats: dict) -> str:
    return f"{_fmt(stats['mean'])} ± {_fmt(stats['sd'])}"


def summary(values: list) -> dict:
    """Mean, sample standard deviation, standard error of the mean, and every value."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"mean": None, "sd": None, "se": None, "values": []}
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "se": sd / math.sqrt(len(values)), "values": values}


def aggregate(per_seed: dict[int, dict]) -> dict:
    """One row over seeds: every seed's row kept, the measured figures summarised (:func:`summary`)."""
    rows = list(per_seed.values())
    first = rows[0]
    return {
        "variant": first["variant"],
        "label_source": first["label_source"],
        "training_data": first["training_data"],
        "steps": first["steps"],
        "overrides": first["overrides"],
        "K": first["K"],
        "greedy_equal": all(r["greedy_equal"] for r in rows),
        "mal": summary([r["mal"] for r in rows]),
        "ceiling": first["ceiling"],
        "fraction_of_ceiling": summary([r["fraction_of_ceiling"] for r in rows]),
        "after_correction_mal": summary([r["after_correction_mal"] for r in rows]),
        "first_acceptance": summary([r["per_position"][0]["acceptance"] for r in rows]),
        "val_accept_len": summary([r["val_accept_len"] for r in rows]),
        "val_serving_mal": summary([r.get("val_serving_mal") for r in rows]),
        "serving_over_teacher_forced": summary(
            [r["mal"] / r["val_accept_len"] for r in rows if r["val_accept_len"]]),
        "train_wall_s": summary([r["train_wall_s"] for r in rows]),
        "per_seed": {str(seed): row for seed, row in per_seed.items()},
    }


def versus(row: dict, baseline: dict, baseline_name: str) -> dict:
    """``row``'s mean serving MAL against ``baseline``'s: the difference, its standard error (the two means'
    SEs combined) and whether it wins (difference > WIN_STANDARD_ERRORS · SE); per-seed differences kept."""
    difference = row["mal"]["mean"] - baseline["mal"]["mean"]
    error = math.sqrt(row["mal"]["se"] ** 2 + baseline["mal"]["se"] ** 2)
    paired = [a - b for a, b in zip(row["mal"]["values"], baseline["mal"]["values"])]
    return {"baseline": baseline_name, "difference": difference, "standard_error": error,
            "wins": difference > WIN_STANDARD_ERRORS * error, "per_seed_differences": paired}


def ceiling_mal(reply_lengths: list[int], k: int) -> float:
    """Pooled MAL of a draft that is always right, over replies of these lengths (tokens, the stop token
    included): the prefill makes the first token, every round accepts K and adds its bonus, and the last
    round accepts what is left (at most K), as the decoder's counters count it."""
    accepted = rounds = 0
    for length in reply_lengths:
        after_prefill = length - 1
        if after_prefill <= 0:
            continue
        count = math.ceil(after_prefill / (k + 1))
        accepted += k * (count - 1) + min(after_prefill - (count - 1) * (k + 1), k)
        rounds += count
    return (accepted + rounds) / rounds if rounds else float("nan")


def after_correction_mal(rounds_per_reply: list[list[int]], k: int) -> float | None:
    """Pooled MAL of the rounds that start right after the target corrected the draft (the previous round
    accepted fewer than K), where serving loses most (docs/benchmarks.md)."""
    accepted = [a for rounds in rounds_per_reply for (_, kind), a in zip(round_starts(rounds, k), rounds)
                if kind == AFTER_CORRECTION]
    return 1 + sum(accepted) / len(accepted) if accepted else None


def served_figures(row: dict, report: dict, name: str) -> dict:
    """``row`` with the serving figures of draft ``name`` in an evaluation report."""
    draft = report["drafts"][name]
    k = report["settings"]["num_speculative_tokens"]
    ceiling = ceiling_mal([len(sample["target"]["token_ids"]) for sample in report["samples"]], k)
    rounds_per_reply = [sample["drafts"][name]["accepted_per_round"] for sample in report["samples"]]
    row.update(K=k, mal=draft["acceptance"]["mal"], ceiling=ceiling, fraction_of_ceiling=draft["acceptance"]["mal"] / ceiling,
               after_correction_mal=after_correction_mal(rounds_per_reply, k), rounds=draft["acceptance"]["rounds"], per_position=draft["acceptance"]["per_position"],
               greedy_equal=draft["greedy_equal"], wer=draft["wer"]["wer"], truncated=len(draft["truncated_ids"]))
    return row


def eagle3_at_k(target: Path, trained: dict[str, dict[int, dict]], k: int, test: Path, max_new_tokens: int,
                work: Path, served: dict[str, dict[int, dict]]) -> int:
    """Every EAGLE-3 row's drafts (all seeds, one pass) at ``k`` proposals per round, a chain length other than the
    ``ttt_steps`` it was trained for, into ``served`` as row ``"<name> K=<k>"``; returns the failures."""
    drafts = {f"{n}@{seed}": r for n, rows in trained.items() for seed, r in rows.items() if r["variant"] == "eagle3"}
    if not drafts:
        return 0
    report = evaluate_drafts(target, {key: r["export"] for key, r in drafts.items()}, test, None, max_new_tokens,
                             work / f"eval-eagle3-k{k}.json", num_speculative_tokens=k)
    for key, row in drafts.items():
        name, seed = key.rsplit("@", 1)
        served.setdefault(f"{name} K={k}", {})[int(seed)] = served_figures(dict(row), report, key)
    return len(report["failures"])


def run(target: Path, steps: int, label_limit: int, eval_limit: int | None, seeds: list[int], max_new_tokens: int,
        variants: list[str], work: Path, cuts: tuple[Path, Path] | None = None,
        reuse_labels: bool = False, eagle3_ks: tuple[int, ...] = ()) -> dict:
    """The whole benchmark: every variant trained once per seed on identical data, labels, steps and K, all
    block drafts evaluated in one pass (EAGLE-3 rows also at each K of ``eagle3_ks``); ``cuts`` (train, test)
    replaces the reference corpus (tests use a tiny one)."""
    started = time.perf_counter()
    if not (target / "model.safetensors").exists():
        raise SystemExit(f"no reference target in {target}: run benchmarks/train_reference_target.py")
    t0 = time.perf_counter()
    subset, test_subset, train_labels, test_labels = labelled_data(target, work, label_limit, eval_limit,
                                                                   max_new_tokens, cuts, reuse_labels)
    labels_wall = time.perf_counter() - t0

    trained: dict[str, dict[int, dict]] = {name: {} for name in variants}
    for seed in seeds:
        for name in variants:
            variant, data, label_source, extra = VARIANTS[name]
            train, val = (train_labels, test_labels) if data == "offline" else (subset, test_subset)
            row = train_variant(target, name, variant, label_source, train, val, work / "runs" / f"{name}-s{seed}",
                                steps, seed, extra)
            row["training_data"] = "target's greedy (offline)" if data == "offline" else "original transcripts"
            trained[name][seed] = row

    t0 = time.perf_counter()
    served: dict[str, dict[int, dict]] = {}
    blocks = {f"{n}@{seed}": r for n, rows in trained.items() for seed, r in rows.items() if r["variant"] != "mtp"}
    report = evaluate_drafts(target, {key: r["export"] for key, r in blocks.items()}, test_subset, None,
                             max_new_tokens, work / "eval.json") if blocks else None
    failures = len(report["failures"]) if report else 0
    for key, row in blocks.items():
        name, seed = key.rsplit("@", 1)
        served.setdefault(name, {})[int(seed)] = served_figures(row, report, key)
    for name, rows in trained.items():
        for seed, row in rows.items():
            if row["variant"] != "mtp":
                continue
            for label, k in (("K=D", row["trained_k"]), ("K=2D", 2 * row["trained_k"])):
                mtp_report = evaluate_drafts(Path(row["export"]), {MTP: TARGET_MTP_HEADS}, test_subset, None,
                                             max_new_tokens, work / f"eval-{name}-s{seed}-k{k}.json",
                                             num_speculative_tokens=k)
                served.setdefault(f"{name} {label}", {})[seed] = served_figures(dict(row), mtp_report, MTP)
                failures += len(mtp_report["failures"])
                report = report or mtp_report
    for k in eagle3_ks:
        failures += eagle3_at_k(target, trained, k, test_subset, max_new_tokens, work, served)
    eval_wall = time.perf_counter() - t0
    rows = {name: aggregate(per_seed) for name, per_seed in served.items()}
    for name, row in rows.items():
        family, _, k_label = name.partition(" ")
        base = baseline_of(family, [n.partition(" ")[0] for n in rows])
        if base is not None:
            base_name = f"{base} {k_label}".strip()
            row["versus"] = versus(row, rows[base_name], base_name)
    k = max((r["K"] for n, r in rows.items() if r["variant"] != "mtp"), default=None)
    results = {
        "K": k,
        "seeds": list(seeds),
        "samples_evaluated": report["samples_evaluated"],
        "failures": failures,
        "rounds_note": "max_new_tokens %d, %d target-only truncations" % (
            max_new_tokens, len(report["target_only"]["truncated_ids"])),
        "target_wer": report["target_only"]["wer"]["wer"],
        "target": str(target),
        "labelled_train_utterances": label_limit,
        "labels_wall_s": round(labels_wall, 1),
        "eval_wall_s": round(eval_wall, 1),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "variants": rows,
    }
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(TARGET_DIR),
                        help="a reference target's checkpoint directory (default: the SALM reference target)")
    parser.add_argument("--steps", type=int, default=600,
                        help="training steps per draft (same for every variant; default %(default)s)")
    parser.add_argument("--label-limit", type=int, default=1200,
                        help="training utterances labelled and trained on (default %(default)s)")
    parser.add_argument("--eval-limit", type=int, default=0,
                        help="held-out utterances evaluated (default %(default)s: all 100)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44],
                        help="every variant is trained once per seed (default %(default)s)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                        help="default: %(default)s; a row NAME+METHOD is compared with row NAME")
    parser.add_argument("--work", default=None,
                        help="output directory (default: benchmarks/.work/acceptance, acceptance-<target name> for "
                             "another target)")
    parser.add_argument("--reuse-labels", action="store_true",
                        help="keep offline labels already in --work from a run with the same target and limits")
    parser.add_argument("--eagle3-k", type=int, nargs="*", default=[3, 5],
                        help="EAGLE-3 rows are also served at these K (default %(default)s; the table's K is ttt_steps)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    target = Path(args.target).resolve()
    work = Path(args.work) if args.work else WORK / (
        "acceptance" if target == TARGET_DIR.resolve() else f"acceptance-{target.name}")
    results = run(target, args.steps, args.label_limit, args.eval_limit, args.seeds, args.max_new_tokens,
                  args.variants, work, reuse_labels=args.reuse_labels, eagle3_ks=tuple(args.eagle3_k))
    print("\n".join(table(results)))
    return 0 if results["failures"] == 0 and all(r["greedy_equal"] for r in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
