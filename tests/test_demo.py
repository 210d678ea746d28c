"""``make demo`` (``dflash_train.cli.demo``): a real run that ends with the reference decoder's table on the
validation set, and the one-line error when the demo's target is not where the recipe says."""

from __future__ import annotations

import json

from conftest import REPO_ROOT, compose

from dflash_train.target.vllm_export import serve_command


def test_the_demo_ends_with_the_evaluation_table_and_writes_its_json_and_plot(demo_data, tmp_path, monkeypatch, capsys):
    from dflash_train.cli.demo import main

    train_cuts, val_cuts = demo_data
    run_dir = tmp_path / "runs" / "demo"
    monkeypatch.chdir(tmp_path)
    status = main([
        f"model.pretrained_name={REPO_ROOT / 'benchmarks' / 'reference_target'}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "dflash.serving_val_samples=0", "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ])
    out = capsys.readouterr().out
    assert status == 0, out
    serve = next(line for line in out.splitlines() if line.startswith("serve: "))
    assert f'"method": "dflash", "model": "{run_dir.resolve() / "export"}"' in serve and str(run_dir / "target") in serve
    cpu = next(line for line in out.splitlines() if line.startswith("serve on vLLM's CPU build: "))
    target, export = run_dir.resolve() / "target", run_dir.resolve() / "export"
    assert cpu.partition(": ")[2] == serve_command(target, export, 7, cpu=True)  # run as printed in test-vllm
    _, heading, table = out.partition("=== the draft on the held-out validation set")
    assert heading, f"no evaluation after training:\n{out}"
    assert "dflash-eval --config-name demo --draft" in table.splitlines()[0]
    assert "4 of 4 samples evaluated, 0 failed; K=7" in table and "MAL (pooled)" in table
    assert "greedy-equal samples" in table and "WER target-only" in table
    assert f"report: {run_dir / 'eval.json'}" in table and f"plot: {run_dir / 'eval.png'}" in table
    assert len(json.loads((run_dir / "eval.json").read_text())["samples"]) == 4
    assert (run_dir / "eval.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "demo_assets").exists(), "data given by overrides: nothing to synthesize"


def test_the_demo_names_a_missing_target_and_the_fix_in_one_line(tmp_path, monkeypatch, capsys):
    from dflash_train.cli.demo import main

    default = compose("demo").model.pretrained_name
    assert (REPO_ROOT / default / "model.safetensors").is_file(), "the demo's default target is the stored one"
    monkeypatch.chdir(tmp_path)
    assert main([f"exp_manager.explicit_log_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"demo: error: the demo's target model.pretrained_name={default} does not exist under {tmp_path}: "
        "run the demo from the repository root (`make demo`) or pass model.pretrained_name=<SALM checkpoint dir>"
    ]
    assert list(tmp_path.iterdir()) == [], "nothing is written before the target is found"
