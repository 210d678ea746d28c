"""`benchmarks/gpu_check.py --cpu-smoke` runs end to end, so the GPU check cannot rot between GPU sessions,
and what it imports is what `gpu_check.sh` carries to a stock GPU image."""

import json
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name
from stock_image import STOCK_IMAGE, carried, closure

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_smoke_fits_exports_and_resumes(tmp_path):
    out = tmp_path / "report.json"
    # as on the stock GPU image: only torch, lightning, transformers and the carried wheels importable
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "stock_image.py"), str(REPO / "benchmarks" / "gpu_check.py"),
                           "--cpu-smoke", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    fit, sizes = report["fit"], report["sizes"]
    assert fit["steps"] == sizes["steps"] and len(fit["step_times_s"]) == sizes["steps"]
    assert fit["resumed_to_step"] == sizes["steps"] + 2
    assert fit["export_tensors_verified"] > 0
    assert fit["params_draft_non_embedding"] > 0 and fit["params_target_non_embedding"] > 0
    assert report["backend_agreement"] == {"ran": False, "reason": "flex_attention's backward needs CUDA"}
    # the exit code's checks, each true: exact resume of the weights, validation, syncs, precision
    assert report["checks"] and all(report["checks"].values()), report["checks"]
    assert fit["resume_weights_max_abs_diff"] == 0.0 and fit["validation_loss"] is not None
    assert fit["host_syncs_between_log_steps_max"] <= 3 and fit["gradient_clip_val"] == 1.0
    assert set(report["phases_s"]) == {"data_wait", "target", "draft_forward", "backward", "optimizer"}  # dflash-smoke's
    assert all(entry["blocks"] > 0 for entry in report["memory_by_anchors"].values())
    # dflash-plan's prediction of each measured step stands beside it (planned without NeMo, as on the stock
    # image), and grows with the anchors
    planned = [(entry["planned_peak_gib"], entry["planned_step_bound_ms"])
               for entry in report["memory_by_anchors"].values()]
    assert min(planned[0]) > 0
    assert all(later[0] > earlier[0] and later[1] > earlier[1] for earlier, later in zip(planned, planned[1:]))
    assert out.with_suffix(".md").read_text().startswith("| figure | value |")

    # every distribution the check imported is on the stock image or carried, at the version tested here
    imported = {canonicalize_name(name): version for name, version in report["imported_distributions"].items()}
    stock, pins = closure(STOCK_IMAGE), carried()
    assert {"torch", "nemo-automodel", "lhotse", "datasets"} <= imported.keys()
    assert not set(imported) - stock - set(pins) - {"dflash-train"}, "stock_image.py hid nothing"
    unused = sorted(set(pins) - set(imported))
    assert not unused, f"gpu_check_wheels.txt carries {unused}, which the check never imports"
    stale = {name: (pin, imported[name]) for name, pin in pins.items() if name in imported and imported[name] != pin}
    assert not stale, f"gpu_check_wheels.txt pins differ from the tested versions (pinned, tested): {stale}"


def test_gpu_check_without_a_gpu_says_how_to_run_it():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "no CUDA device: run on a GPU, or pass --cpu-smoke" in proc.stderr
