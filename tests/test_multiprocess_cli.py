"""Two gloo processes through the real CLI (`torchrun -m dflash_train --config-name=demo`), real data module.

What users run on an 8-GPU node, at world size 2 on CPU: the demo recipe, lhotse cuts of
real speech with one planted broken record, the real `SpeechDataModule`. The evidence comes
from the run's own output: the per-rank sample-id logs (`exp_manager.record_sample_ids`),
the run summary, the Hydra run directory and the export.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_launcher
from safetensors.torch import load_file

BIN = Path(sys.executable).parent
STEPS = 8
MISSING_ID = "planted-missing-audio"


def _records(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def cuts(demo_data, tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """Train cuts = the demo fixture's 20 utterances + one record whose audio file does not exist."""
    train, val = demo_data
    records = _records(train)
    broken = json.loads(json.dumps(records[0]))
    broken["id"] = broken["supervisions"][0]["id"] = MISSING_ID
    broken["recording"]["id"] = broken["supervisions"][0]["recording_id"] = MISSING_ID
    broken["recording"]["sources"][0]["source"] = str(tmp_path_factory.mktemp("gone") / "missing.wav")
    records.insert(5, broken)
    out = tmp_path_factory.mktemp("cuts") / "train_cuts.jsonl.gz"
    with gzip.open(out, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return out, val, [r["id"] for r in records]


def _command(salm_dir, cuts, run_dir: Path, exp_dir: Path) -> list[str]:
    train, val, _ = cuts
    return [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dflash_train", "--config-name=demo",
        "trainer.devices=2",
        f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train}",
        f"data.validation_ds.input_cfg.0.cuts_path={val}",
        # in-order batches, so one pass over each shard is provably complete after STEPS steps
        "data.train_ds.use_bucketing=false",
        "data.train_ds.shuffle=false",
        "++data.validation_ds.batch_size=1",
        "data.validation_ds.batch_tokens=null",
        "data.validation_ds.use_bucketing=false",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=null",
        "trainer.log_every_n_steps=1",
        "+trainer.enable_progress_bar=false",
        f"exp_manager.explicit_log_dir={run_dir}",
        f"exp_manager.exp_dir={exp_dir}",
        "exp_manager.resume_if_exists=true",
        "exp_manager.checkpoint_every_n_steps=1000",  # no periodic checkpoint: only preemption saves one
        "exp_manager.record_sample_ids=true",
        # serving-aware anchors on: mining is a collective and its memory must survive the preemption checkpoint
        "dflash.serving_anchor_fraction=0.5",
        "dflash.serving_anchor_every=2",
    ]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _run(command: list[str]) -> str:
    proc = run_launcher(command, _env(), 600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _sample_log(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "sample_ids" / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tiny_salm_dir, cuts, tmp_path_factory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("straight")
    output = _run(_command(tiny_salm_dir, cuts, root / "run", root / "exp"))
    return root / "run", root / "exp", output


def test_ranks_train_on_disjoint_shards_that_cover_the_data(straight, cuts):
    run_dir, _, _ = straight
    _, val, ids = cuts
    usable = [i for i in ids if i != MISSING_ID]
    seen = {}
    for rank in (0, 1):
        batches = [r for r in _sample_log(run_dir, rank) if r["split"] == "train"]
        assert [r["step"] for r in batches] == list(range(STEPS))
        seen[rank] = {i for r in batches for i in r["ids"]}
        # record i of the input belongs to rank i % 2 (the documented shard rule)
        assert seen[rank] == {i for index, i in enumerate(ids) if index % 2 == rank and i != MISSING_ID}
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(usable)


def test_ranks_validate_on_disjoint_halves_of_the_validation_set(straight, cuts):
    run_dir, _, _ = straight
    _, val, _ = cuts
    val_ids = [r["id"] for r in _records(val)]
    per_rank = []
    for rank in (0, 1):
        runs = {}
        for r in _sample_log(run_dir, rank):
            if r["split"] != "train":
                runs.setdefault(r["step"], []).extend(r["ids"])
        assert sorted(runs) == [4, 8]
        assert runs[4] == runs[8]  # the same share at every validation
        per_rank.append(runs[4])
    assert len(per_rank[0]) == len(per_rank[1]) == len(val_ids) // 2
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(val_ids)


def test_a_broken_record_is_counted_once_over_both_ranks(straight):
    _, _, output = straight
    summaries = [line for line in output.splitlines() if "skipped samples:" in line]
    assert len(summaries) == 2 and all(line.endswith("skipped samples: missing_audio 1") for line in summaries)


def test_both_ranks_decode_their_share_of_serving_validation_and_report_the_pooled_counters(straight, tiny_salm_dir,
                                                                                            cuts):
    """val/serving_mal of a 2-rank run is exactly dflash-eval's pooled MAL on the export, over the same
    validation records (each rank decoded half of them): one rank's counters alone would not match."""
    import csv

    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import evaluate, prepare

    run_dir, _, output = straight
    _, val, _ = cuts
    settings, loaded = prepare(TargetSource(checkpoint=str(tiny_salm_dir)), {"draft": str(run_dir / "export")},
                               InputConfig(type="lhotse_as_conversation", cuts_path=str(val)), max_new_tokens=64,
                               dtype="float32", limit=16)
    counters = evaluate(settings, loaded).counters("draft")
    with open(next(run_dir.rglob("metrics.csv"))) as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/serving_rounds")]
    assert [int(float(row["step"])) for row in rows] == [3, 7]  # Lightning's 0-based step of validations 4 and 8
    assert int(float(rows[-1]["val/serving_rounds"])) == counters.rounds > 0
    summaries = [line for line in output.splitlines() if "steps: 8;" in line]
    assert len(summaries) == 2 and all(line.endswith(f"serving MAL {counters.mal:.4f}") for line in summaries)


def test_the_checkpoint_holds_the_round_starts_both_ranks_mined(straight):
    """Serving-aware anchors: each rank mines its own rows (steps 0, 2, 4, 6); the checkpoint rank 0 writes
    must hold both ranks' memories, or a resumed rank would forget its own."""
    import torch

    from dflash_train.training.serving_anchors import CHECKPOINT_KEY

    run_dir, _, _ = straight
    mined = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[CHECKPOINT_KEY]
    for rank in (0, 1):
        rows = [r for r in _sample_log(run_dir, rank) if r["split"] == "train" and r["step"] in (0, 2, 4, 6)]
        assert {i for r in rows for i in r["ids"]} <= set(mined), rank


def test_all_ranks_share_one_hydra_run_directory(straight):
    _, exp_dir, _ = straight
    launches = list((exp_dir / "demo" / "hydra").iterdir())
    assert len(launches) == 1, launches
    assert sorted(p.name for p in launches[0].glob("*.log")) == ["dflash_train_rank0.log", "dflash_train_rank1.log"]


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_ends_with_the_same_weights(straight, tiny_salm_dir, cuts, tmp_path):
    run_dir = tmp_path / "run"
    command = _command(tiny_salm_dir, cuts, run_dir, tmp_path / "exp")
    log_path = tmp_path / "preempted.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while "step 2/" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both workers
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    output = log_path.read_text()
    notes = [line for line in output.splitlines() if "preempted by SIGTERM at step" in line]
    assert len(notes) == 2, output[-4000:]  # both ranks report it
    stopped_at = int(notes[0].split("at step ")[1].split(":")[0])
    assert 2 <= stopped_at < STEPS
    import torch

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stopped_at
    assert not (run_dir / "export").exists()

    resumed = _run(command)
    assert f"resumed from {run_dir / 'checkpoints' / 'last.ckpt'} at global step {stopped_at}" in resumed
    ours = load_file(str(run_dir / "export" / "model.safetensors"))
    ref = load_file(str(straight[0] / "export" / "model.safetensors"))
    assert ours.keys() == ref.keys()
    worst = max((ours[k].float() - ref[k].float()).abs().max().item() for k in ref)
    print(f"\nSIGTERM at step {stopped_at} + resume vs uninterrupted: max |Δw| = {worst:.3g}")
    assert worst <= 1e-6


STAMP_WORKER = """
import os, sys, time
time.sleep(2.5 * int(os.environ["RANK"]))  # rank 1 asks later, as a rank on a slow node would
from dflash_train.training.launch import launch_stamp
open(os.path.join(sys.argv[1], "stamp" + os.environ["RANK"]), "w").write(launch_stamp())
"""


def test_launch_stamp_is_one_value_for_ranks_started_seconds_apart(tmp_path):
    (tmp_path / "worker.py").write_text(STAMP_WORKER)
    _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(tmp_path / "worker.py"), str(tmp_path)])
    stamps = [(tmp_path / f"stamp{rank}").read_text() for rank in (0, 1)]
    assert stamps[0] == stamps[1] and len(stamps[0]) == len("2026-12-01_07-54-57"), stamps
