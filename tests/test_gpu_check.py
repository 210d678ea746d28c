"""`benchmarks/gpu_check.py --cpu-smoke` runs end to end, so the GPU check cannot rot between GPU sessions."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_smoke_fits_exports_and_resumes(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    fit, sizes = report["fit"], report["sizes"]
    assert fit["steps"] == sizes["steps"] and len(fit["step_times_s"]) == sizes["steps"]
    assert fit["resumed_to_step"] == sizes["steps"] + 2
    assert fit["export_tensors_verified"] > 0
    assert fit["params_draft_non_embedding"] > 0 and fit["params_target_non_embedding"] > 0
    assert report["backend_agreement"] == {"ran": False, "reason": "flex_attention's backward needs CUDA"}


def test_gpu_check_without_a_gpu_says_how_to_run_it():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "no CUDA device: run on a GPU, or pass --cpu-smoke" in proc.stderr
