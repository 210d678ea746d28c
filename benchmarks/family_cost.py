"""What each draft family costs to train on the reference targets: step time and trained parameters, side by side.

    .venv/bin/python benchmarks/family_cost.py [--targets salm nemotron_h] [--families dflash dflash2 mtp eagle3]
                                               [--steps 20 60] [--rounds 2]

Each family is trained exactly as ``benchmarks/acceptance.py`` trains its rows (the demo recipe with the
benchmark's overrides, the acceptance benchmark's offline labels, which this script makes when they are
missing) for two budgets; the step time is the difference of the two wall times over the difference of the
budgets, so start-up, the target's load and the one (teacher-forced) validation at the end cancel; serving
validation is off, since its decode lasts as long as the draft is bad. Rounds interleave the
families (round-robin over targets, families and budgets) so the machine's noise hits them alike; the
figure per family is the median over rounds, every round's kept. Trained parameters: the entries of AdamW's
first moments in the run's last checkpoint (one per parameter the optimizer steps).

Writes ``benchmarks/.work/family_cost/results.json`` and prints one table. A CPU figure: the ratios between
families, not the absolute times, are what transfers; GPU step time and memory per family at the public
targets' sizes are ``dflash-plan``'s (``benchmarks/plan_table.py --families``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import acceptance  # noqa: E402
from train_reference_target import OUT as SALM_TARGET  # noqa: E402
from train_reference_target import WORK  # noqa: E402

TARGETS = {"salm": SALM_TARGET, "nemotron_h": ROOT / "benchmarks" / "reference_target_nemotron_h"}
FAMILIES = ("dflash", "dflash2", "mtp", "eagle3")
OUT = WORK / "family_cost"
# serving validation decodes for as long as the draft is bad, so it would not cancel between the two budgets
QUALITY_FREE = ("dflash.serving_val_samples=0",)


def _labels(target: Path, label_limit: int, max_new_tokens: int) -> tuple[Path, Path]:
    """The acceptance benchmark's offline labels for ``target`` (made in its work directory when missing)."""
    work = WORK / ("acceptance" if target == SALM_TARGET else f"acceptance-{target.name}")
    *_, train, test = acceptance.labelled_data(target, work, label_limit, None, max_new_tokens, reuse=True)
    return train, test


def trained_parameters(run_dir: Path) -> int:
    """Parameters the optimizer steps in the run's last checkpoint (AdamW keeps two moments of each)."""
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    moments = state["optimizer_states"][0]["state"].values()
    return sum(m["exp_avg"].numel() for m in moments)


def run(targets: list[str], families: list[str], steps: tuple[int, int], rounds: int, seed: int = 42,
        label_limit: int = 1200, max_new_tokens: int = 48) -> dict:
    """Every (target, family) trained for both budgets once per round, interleaved; per-step times per round."""
    short, long = steps
    labels = {name: _labels(TARGETS[name], label_limit, max_new_tokens) for name in targets}
    walls: dict[str, dict[str, dict[int, list[float]]]] = {t: {f: {short: [], long: []} for f in families}
                                                          for t in targets}
    params: dict[str, dict[str, int]] = {t: {} for t in targets}
    for _ in range(rounds):
        for target_name in targets:
            train, test = labels[target_name]
            for family in families:
                variant, _, label_source, extra = acceptance.VARIANTS[family]
                for budget in (short, long):
                    run_dir = OUT / "runs" / f"{target_name}-{family}"
                    row = acceptance.train_variant(TARGETS[target_name], f"cost-{family}", variant, label_source,
                                                   train, test, run_dir, budget, seed, (*extra, *QUALITY_FREE))
                    walls[target_name][family][budget].append(row["train_wall_s"])
                params[target_name][family] = trained_parameters(run_dir)
    rows = {}
    for target_name in targets:
        for family in families:
            w = walls[target_name][family]
            per_round = [(b - a) / (long - short) * 1000 for a, b in zip(w[short], w[long])]
            rows[f"{target_name}/{family}"] = {
                "target": target_name, "family": family,
                "step_ms_median": round(statistics.median(per_round), 1),
                "step_ms_per_round": [round(x, 1) for x in per_round],
                "trained_parameters": params[target_name][family],
                "walls_s": {str(k): v for k, v in w.items()},
            }
    for target_name in targets:
        base = rows.get(f"{target_name}/dflash2")
        for family in families:
            row = rows[f"{target_name}/{family}"]
            if base:
                row["step_vs_dflash2"] = round(row["step_ms_median"] / base["step_ms_median"], 2)
    return {"steps": list(steps), "rounds": rounds, "seed": seed, "torch_threads": torch.get_num_threads(),
            "rows": rows}


def table(results: dict) -> list[str]:
    lines = ["| target | family | step (ms, median) | per round | vs DFlash2 | trained parameters |",
             "|---|---|---|---|---|---|"]
    for row in results["rows"].values():
        lines.append(f"| {row['target']} | {row['family']} | {row['step_ms_median']:.0f} | "
                     f"{', '.join(f'{x:.0f}' for x in row['step_ms_per_round'])} | "
                     f"{row.get('step_vs_dflash2', float('nan')):.2f}× | {row['trained_parameters']:,} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, nargs=2, default=[20, 60], metavar=("SHORT", "LONG"),
                        help="the two budgets whose wall-time difference gives the step time")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps[1] <= args.steps[0]:
        parser.error("--steps: the second budget must be larger than the first")
    results = run(args.targets, args.families, tuple(args.steps), args.rounds)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(table(results)))
    print(f"wrote {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
