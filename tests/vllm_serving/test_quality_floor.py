"""A quality floor for CI: the demo's trained drafts keep their acceptance.

`make test-vllm` trains the demo three ways before these tests (runs/demo: DFlash; runs/demo-dflash2;
runs/demo-mtp), and each demo ends with `dflash-eval` on the 32 held-out validation utterances
(K = 7, MTP K = 2, greedy, float32 target, bfloat16 perception), writing ``eval.json``. Its pooled MAL must
stay within 10 % of the value measured when the floor was set, so a change that costs a tenth of
the demo's acceptance (let alone half) fails CI. Reference values: `make demo` and
`python -m dflash_train.cli.demo dflash=<variant> exp_manager.explicit_log_dir=runs/demo-<variant>`
on the 2-core development machine, 2026-12-03 (docs/benchmarks.md, "Demo quality floor"), after the
draft's initialisation became the seed's own.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, missing_trained

MEASURED = {  # run directory: (K, pooled MAL)
    "runs/demo": (7, 3.299),  # DFlash, 423 accepted / 184 rounds (seed 42; seeds 43 and 44: 4.045, 3.696)
    "runs/demo-dflash2": (7, 5.098),  # DFlash2 (shipped selector weight), 500 / 122
    "runs/demo-mtp": (2, 2.893),  # MTP heads (one repeated step), 407 / 215
}
FLOOR = 0.9


@pytest.mark.parametrize("run", sorted(MEASURED))
def test_the_demo_keeps_its_pooled_mal(run):
    report_path = REPO_ROOT / run / "eval.json"
    if not report_path.exists():
        missing_trained(f"no {run}/eval.json: `make test-vllm` trains the demo there and evaluates it")
    report = json.loads(report_path.read_text())
    assert not report["provisional"] and report["samples_evaluated"] == report["samples_expected"] == 32
    (draft,) = report["drafts"].values()
    k, measured = MEASURED[run]
    assert report["settings"]["num_speculative_tokens"] == k and draft["greedy_equal"] is True
    mal = draft["acceptance"]["mal"]
    print(f"\n{run}: pooled MAL {mal:.3f} (measured {measured}, floor {FLOOR * measured:.3f})")
    assert mal >= FLOOR * measured, f"{run}: pooled MAL {mal:.3f} fell below {FLOOR:.0%} of {measured}"
