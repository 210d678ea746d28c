"""``dflash-smoke`` through its real command line: the demo recipe on the tiny SALM (DFlash2, one process and two
torchrun processes), MTP heads on a tiny Nemotron-H target, and each checklist item failing with its fault planted.

The planted faults (``DFLASH_SMOKE_FAULTS``, dflash_train/smoke/meter.py) are applied together in one smoke: each
breaks a different item, so the run's failed items are exactly the five, while the clean runs pass them all.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import compose, free_port, run_launcher, run_launchers, tiny_run_overrides

BIN = Path(sys.executable).parent
STEPS = 4
ITEMS = ["finite_loss_and_gradients", "trainable_parameters", "steps_advance", "skips_by_reason",
         "validation_valid_anchors", "checkpoint_shards", "exact_resume", "export_reload"]


def _tiny_demo(salm_dir, demo_data, run_dir: Path, *extra: str) -> list[str]:
    train, val = demo_data
    return ["--config-name=demo", f"model.pretrained_name={salm_dir}", f"data.train_ds.input_cfg.0.cuts_path={train}",
            f"data.validation_ds.input_cfg.0.cuts_path={val}", "data.train_ds.bucket_estimate_samples=20",
            "trainer.precision=32-true", "+trainer.enable_progress_bar=false", f"exp_manager.explicit_log_dir={run_dir}",
            "--steps", str(STEPS), *extra]


DFLASH2 = ["dflash=dflash2", "dflash.selector_rank=16", "dflash.selector_top_k=8"]


def _env(**extra: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "DFLASH_SMOKE_FAULTS"}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


FAULTS = "nan_gradient,trainable_target,missing_shard,resume_drift,export_not_reloading"


def _report(out: Path) -> dict:
    report = json.loads((out / "smoke.json").read_text())
    assert [item["name"] for item in report["items"]] == ITEMS
    return report


def _items(report: dict) -> dict[str, dict]:
    return {item["name"]: item for item in report["items"]}


@pytest.fixture(scope="module")
def one_process_smokes(tiny_salm_dir, tiny_hybrid_dir, demo_data, tmp_path_factory) -> dict:
    """The module's one-process smokes, launched side by side (one core each): ``clean`` (DFlash2, the default out
    directory, beside the run directory), ``faults`` (DFlash2 with :data:`FAULTS` planted) and ``mtp`` (MTP heads on
    the tiny Nemotron-H target, accumulating 2 micro-batches, a StepLR schedule). Per name: ``(directory,
    CompletedProcess)``; each launch has a rendezvous port of its own."""
    roots = {name: tmp_path_factory.mktemp(name) for name in ("clean", "faults", "mtp")}
    args = {
        "clean": _tiny_demo(tiny_salm_dir, demo_data, roots["clean"] / "run", *DFLASH2),
        "faults": _tiny_demo(tiny_salm_dir, demo_data, roots["faults"] / "run", *DFLASH2,
                             "--out", str(roots["faults"] / "out")),
        "mtp": _tiny_demo(tiny_hybrid_dir, demo_data, roots["mtp"] / "run", "model=salm_automodel", "dflash=mtp",
                          "trainer.accumulate_grad_batches=2",
                          "dflash.lr_scheduler={_target_:torch.optim.lr_scheduler.StepLR,step_size:1,gamma:0.5}",
                          "--out", str(roots["mtp"] / "out")),
    }
    envs = [_env(MASTER_PORT=str(free_port()), **({"DFLASH_SMOKE_FAULTS": FAULTS} if name == "faults" else {}))
            for name in args]
    procs = run_launchers([[sys.executable, "-m", "dflash_train.cli.smoke", *a] for a in args.values()], envs, 600,
                          cwds=list(roots.values()))
    return {name: (roots[name], proc) for name, proc in zip(args, procs)}


def test_one_process_dflash2_passes_every_item_beside_an_untouched_run_directory(one_process_smokes):
    root, proc = one_process_smokes["clean"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert not (root / "run").exists(), "the smoke wrote into the user's run directory"
    (out,) = root.glob("run-smoke-*")
    report = _report(out)
    assert report["passed"] and not report["failed"] and report["world_size"] == 1
    items = _items(report)
    assert "max abs diff 0 " in items["exact_resume"]["evidence"] and "step 2" in items["exact_resume"]["evidence"]
    assert "target parameters trainable: none" in items["trainable_parameters"]["evidence"]
    assert "selector" in items["trainable_parameters"]["evidence"] or "fc.weight" in items["trainable_parameters"]["evidence"]
    figures = report["figures"]
    assert set(figures["phase_median_s"]) == {"data_wait", "target", "draft_forward", "backward", "optimizer"}
    assert all(seconds >= 0 for seconds in figures["phase_median_s"].values()) and figures["tokens_per_s"] > 0
    assert figures["memory"][0]["process_peak_rss_gib"] > 0 and figures["host_syncs_per_step_max"] is not None
    assert figures["mfu"] is None and "MFU = (2·P_target·T" in figures["mfu_note"]
    table = (out / "smoke.md").read_text()
    assert table in proc.stdout and "All items passed." in table and "| finite loss and gradients | pass |" in table


def test_planted_faults_each_fail_their_own_item(one_process_smokes):
    root, proc = one_process_smokes["faults"]
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-6000:]
    report = _report(root / "out")
    expected = ["finite_loss_and_gradients", "trainable_parameters", "checkpoint_shards", "exact_resume", "export_reload"]
    assert report["failed"] == expected
    assert f"dflash-smoke: FAILED: {', '.join(expected)}" in proc.stdout
    items = _items(report)
    assert "steps not applied for a non-finite gradient: 2" in items["finite_loss_and_gradients"]["evidence"]
    assert "train/nonfinite 1" in items["skips_by_reason"]["evidence"]  # the skip, by its reason
    assert "target parameters trainable: " in items["trainable_parameters"]["evidence"]
    assert "trainable: none" not in items["trainable_parameters"]["evidence"]
    assert "missing ['last.ckpt']" in items["checkpoint_shards"]["evidence"]
    assert "max abs diff 0 " not in items["exact_resume"]["evidence"] and "lr [" in items["exact_resume"]["evidence"]
    assert "do not match the draft: missing" in items["export_reload"]["evidence"]


def test_bad_input_fails_in_one_line_before_anything_loads(tiny_salm_dir, demo_data, tmp_path, capsys, monkeypatch):
    from dflash_train.cli.smoke import main

    run_dir = tmp_path / "run"
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    cases = {
        ("--out", str(tmp_path / "taken")): "exists and is not empty",
        ("--out", str(run_dir / "smoke")): "is the run directory",
        ("--steps", "1"): "--steps 1",
        ("dflash.num_anchor=4",): "dflash.num_anchor",
    }
    for extra, message in cases.items():
        assert main(_tiny_demo(tiny_salm_dir, demo_data, run_dir, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dflash-smoke: error: ") and message in err[0], (extra, err)
    monkeypatch.setenv("DFLASH_SMOKE_FAULTS", "nan_grad")
    assert main(_tiny_demo(tiny_salm_dir, demo_data, run_dir)) == 2
    assert "unknown fault(s) ['nan_grad']" in capsys.readouterr().err
    assert not run_dir.exists()


def test_two_torchrun_processes_under_fsdp2(tiny_salm_dir, demo_data, tmp_path):
    """The main recipe's strategy: FSDP2 swaps the draft's registered parameters between sharded and gathered tensors,
    which the trainable-parameter item must see through (it failed comparing tensor identities)."""
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dflash_train.cli.smoke",
               *_tiny_demo(tiny_salm_dir, demo_data, tmp_path / "run", *DFLASH2, "trainer.devices=2",
                           "trainer.strategy.name=fsdp2", "--out", str(tmp_path / "out"))]
    proc = run_launcher(command, _env(), 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = _report(tmp_path / "out")
    assert report["passed"] and report["world_size"] == 2
    assert len(report["figures"]["memory"]) == 2
    assert "(world size 2)" in _items(report)["checkpoint_shards"]["title"]


def test_mtp_heads_on_a_nemotron_h_target_with_accumulation_and_a_schedule(one_process_smokes):
    root, proc = one_process_smokes["mtp"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = _report(root / "out")
    assert report["passed"], report["failed"]
    resume = _items(report)["exact_resume"]["evidence"]
    # the learning rate halved at each of the two steps before the stop, restored with its scheduler
    assert "saved: step 2, lr [0.0005], 1 scheduler(s); resumed: step 2, lr [0.0005], scheduler states equal" in resume
    assert "eh_proj.weight" in _items(report)["trainable_parameters"]["evidence"]  # the MTP step, NeMo's layout


def test_the_plan_stands_beside_the_figures_on_a_gpu_it_knows(tiny_salm_dir, tmp_path):
    """On CUDA the figures carry dflash-plan's bounds and the measured/plan ratio (here: the plan of an H100 and a
    made-up measurement, rendered as the report renders it); on a CPU there is no plan, and the note says why."""

    from dflash_train.config import validate_config
    from dflash_train.smoke.checklist import Figures, Item, markdown
    from dflash_train.smoke.run import plan_prediction

    validated = validate_config(compose("dflash", [*tiny_run_overrides(tiny_salm_dir), "trainer.strategy.name=fsdp2",
                                                   f"exp_manager.explicit_log_dir={tmp_path / 'run'}",
                                                   "data.train_ds.batch_tokens=512", "data.train_ds.max_tokens=256",
                                                   "data.train_ds.max_duration=5", "dflash.num_anchors=64"]))
    assert plan_prediction(validated, 2, None)[0] == {}
    plan, note = plan_prediction(validated, 2, "NVIDIA H100 80GB HBM3")
    assert set(plan) == {"target", "draft_forward", "backward", "optimizer", "step_s", "tokens_per_s", "mfu",
                         "peak_allocated_gib"}, note
    assert all(value >= 0 for value in plan.values()) and "H100" in note
    assert all(plan[key] > 0 for key in ("draft_forward", "backward", "step_s", "tokens_per_s", "mfu", "peak_allocated_gib"))
    phases = {"data_wait": 0.001, "target": 0.01, "draft_forward": 0.02, "backward": 0.03, "optimizer": 0.004}
    figures = Figures(1, 4, phases, sum(phases.values()), 1000.0, 0.2, "MFU = ...",
                      [{"allocated_gib": 1.0, "reserved_gib": 2.0, "process_peak_rss_gib": None}], 3, 4, [], 0, plan)
    text = markdown([Item("x", "x", True, "e")], figures, {"recipe": "r", "world_size": 2, "device": "H100",
                                                           "plan_note": note})
    backward = f"30.0 ms (plan {1000 * plan['backward']:.1f} ms, measured/plan {0.03 / plan['backward']:.2f})"
    assert f"| step time: backward | {backward} |" in text
    assert "measured/plan" in text.split("| MFU |")[1].splitlines()[0]


def test_a_failed_fit_fails_the_items_it_feeds_and_skips_the_fits_after_it(tmp_path):
    """A fit that raised (out of memory, a bad batch) is evidence, not a crash of the smoke: the fits that continue it
    do not run, and the steps, resume and export items fail naming why."""
    from dflash_train.smoke.checklist import FitRun, export_item, resume_item, steps_item
    from dflash_train.smoke.meter import FitRecord, SmokeMeter
    from dflash_train.smoke.run import SmokeRequest, _fit

    straight = FitRun("straight", tmp_path / "straight", FitRecord(), STEPS, error="OutOfMemoryError: CUDA out of memory")
    request = SmokeRequest("demo", steps=STEPS)
    stopped = _fit(request, "stopped", tmp_path / "resumed", False, SmokeMeter(None), after=straight)
    resumed = _fit(request, "resumed", tmp_path / "resumed", True, SmokeMeter(None), after=stopped)
    assert (stopped.error, resumed.error) == ("not run: the straight fit failed", "not run: the stopped fit failed")
    steps = steps_item([straight, stopped, resumed])
    assert not steps.passed and "failed: OutOfMemoryError" in steps.evidence
    resume = resume_item(None, resumed, straight, exact=True)
    assert not resume.passed and "not run: the stopped fit failed" in resume.evidence
    assert not export_item(resumed).passed and not (tmp_path / "resumed").exists()


def test_figures_after_warm_up_and_mfu_by_its_formula():
    """Medians after the first fifth of the steps, the data wait after a validation left out, and MFU on a GPU the
    planner's table holds: T from rank 0's batch times the world size, Q from valid blocks (summed over ranks)."""
    from dflash_train.plan import GPUS
    from dflash_train.smoke.checklist import figures
    from dflash_train.smoke.meter import FitRecord

    phases = {"data_wait": 0.01, "target": 0.02, "draft_forward": 0.03, "backward": 0.04, "optimizer": 0.01}
    record = FitRecord(steps=list(range(1, 11)), phases=[{**phases, "data_wait": 5.0}] + [phases] * 9,
                       after_validation=[True] + [False] * 8 + [True], tokens=[1000] * 10, query_tokens=[800.0] * 10,
                       row_lengths=[100.0] * 10, syncs=[9, 3, 4, 3, 3, 3, 3, 3, 3, 3], memory=[{}, {}])
    params = {"target": 10**6, "draft": 10**5, "hidden": 64, "vocab": 512}
    figs = figures(record, record, params, 2, "NVIDIA H100 80GB HBM3")
    assert (figs.warmup_steps, figs.measured_steps) == (2, 8)
    assert figs.phase_median_s == phases and abs(figs.step_median_s - 0.11) < 1e-12
    flops = 2 * 10**6 * 2000 + 6 * 10**5 * 800 + 4 * 800 * 64 * 512
    assert abs(figs.mfu - flops / (0.11 * GPUS["h100"].bf16_flops * 2)) < 1e-15
    assert abs(figs.tokens_per_s - 2000 / 0.11) < 1e-6 and figs.host_syncs_per_step_max == 4
    assert figures(record, record, params, 2, None).mfu is None


def test_the_plan_column_after_the_fits_left_their_process_group(tiny_salm_dir, tmp_path):
    """On rank 0 after the fits the launch's process group is still initialised (Lightning leaves it): the plan
    column is planned over its own fake group all the same, not refused with "one is already initialised"."""
    import torch.distributed as dist

    from dflash_train.config import validate_config
    from dflash_train.smoke.run import plan_prediction

    validated = validate_config(compose("demo", [*tiny_run_overrides(tiny_salm_dir),
                                                 f"exp_manager.explicit_log_dir={tmp_path / 'run'}"]))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan, note = plan_prediction(validated, 1, "NVIDIA H100 80GB HBM3")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert plan and plan["step_s"] > 0, note
