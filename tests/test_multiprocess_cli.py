"""Two gloo processes through the runbook's own entry script, on the recipe users launch.

`torchrun --standalone --nproc_per_node=2 scripts/dflash_train.py --config-name=demo` with the
main recipe's defaults put back where the demo changes them: FSDP2, DFlash2 with the shipped
selector weight (1.0), 2 loader workers (persistent), shuffling and bucketing on, and the
recipe's precision `bf16-flash` (Lightning bf16-mixed + FSDP2's BF16 policy; CPU autocast runs
it, so the tests use it). Real speech in lhotse cuts with one planted broken record, the real
`SpeechDataModule`. The evidence comes from the run's own outputs: per-rank sample-id logs
(`exp_manager.record_sample_ids`), per-rank Hydra logs, the metrics CSV, checkpoints, the export.

DDP and DFlash stay covered by `tests/test_distributed.py` (2 ranks == 1 process per strategy and
variant on one global batch).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, rank_log_lines, run_launcher, worst_difference
from safetensors.torch import load_file

BIN = Path(sys.executable).parent
STEPS = 8
MISSING_ID = "planted-missing-audio"
RECIPE_DEFAULTS = [
    "trainer.strategy.name=fsdp2",
    "dflash=dflash2",  # selector_loss_weight 1.0, rank 256, top-k 16: the shipped DFlash2 section
    "trainer.precision=bf16-flash",
    "data.train_ds.num_workers=2",  # persistent workers (the loader keeps them across validations)
    "data.train_ds.shuffle=true",
]


def _records(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write_records(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _broken(record: dict, new_id: str, missing: Path) -> dict:
    broken = json.loads(json.dumps(record))
    broken["id"] = broken["supervisions"][0]["id"] = new_id
    broken["recording"]["id"] = broken["supervisions"][0]["recording_id"] = new_id
    broken["recording"]["sources"][0]["source"] = str(missing)
    return broken


@pytest.fixture(scope="module")
def cuts(demo_data, tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """Train cuts = the demo fixture's 24 utterances + one record whose audio file does not exist."""
    train, val = demo_data
    records = _records(train)
    records.insert(5, _broken(records[0], MISSING_ID, tmp_path_factory.mktemp("gone") / "missing.wav"))
    out = _write_records(tmp_path_factory.mktemp("cuts") / "train_cuts.jsonl.gz", records)
    return out, val, [r["id"] for r in records]


def _launch_command(salm_dir, run_dir: Path, exp_dir: Path, train: Path, val: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(REPO_ROOT / "scripts" / "dflash_train.py"),
        "--config-name=demo",
        "trainer.devices=2",
        *RECIPE_DEFAULTS,
        f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train}",
        f"data.validation_ds.input_cfg.0.cuts_path={val}",
        "data.train_ds.bucket_estimate_samples=25",
        "++data.validation_ds.batch_size=1",
        "data.validation_ds.batch_tokens=null",
        "data.validation_ds.use_bucketing=false",
        "trainer.limit_val_batches=null",
        "trainer.log_every_n_steps=1",
        "+trainer.enable_progress_bar=false",
        f"exp_manager.explicit_log_dir={run_dir}",
        f"exp_manager.exp_dir={exp_dir}",
        "exp_manager.resume_if_exists=true",
        "exp_manager.checkpoint_every_n_steps=1000",  # no periodic checkpoint: only preemption saves one
        "exp_manager.record_sample_ids=true",
        *extra,
    ]


def _command(salm_dir, cuts, run_dir: Path, exp_dir: Path, *extra: str) -> list[str]:
    train, val, _ = cuts
    return _launch_command(
        salm_dir, run_dir, exp_dir, train, val,
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=4",
        "dflash.serving_val_samples=3",  # fewer records than steps of a validation: ranks decode 2 and 1
        # serving-aware anchors on: mining is a collective and its memory must survive the preemption checkpoint
        "dflash.serving_anchor_fraction=0.5",
        "dflash.serving_anchor_every=2",
        *extra,
    )


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _run(command: list[str]) -> str:
    proc = run_launcher(command, _env(), 600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _sample_log(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "sample_ids" / f"rank{rank}.jsonl").read_text().splitlines()]


def _metrics(run_dir: Path) -> list[dict]:
    with open(next(run_dir.rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f))


def _export_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tiny_salm_dir, cuts, tmp_path_factory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("straight")
    output = _run(_command(tiny_salm_dir, cuts, root / "run", root / "exp"))
    return root / "run", root / "exp", output


def test_ranks_train_on_disjoint_shards_under_fsdp2_with_shuffling_workers(straight, cuts):
    run_dir, _, _ = straight
    _, _, ids = cuts
    seen = {}
    for rank in (0, 1):
        batches = [r for r in _sample_log(run_dir, rank) if r["split"] == "train"]
        assert [r["step"] for r in batches] == list(range(STEPS))
        seen[rank] = {i for r in batches for i in r["ids"]}
        # record i of the input belongs to rank i % 2 (the documented shard rule), whatever the shuffle
        shard = {i for index, i in enumerate(ids) if index % 2 == rank and i != MISSING_ID}
        assert seen[rank] <= shard
        assert len(seen[rank]) > len(shard) // 2  # shuffled batches from the whole shard, not from one worker's half
    assert not seen[0] & seen[1]


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


def test_a_broken_record_is_counted_once_over_both_ranks_and_its_workers(straight):
    run_dir, _, output = straight
    summaries = rank_log_lines(run_dir, "skipped samples:")
    assert all(len(summaries[rank]) == 1 and summaries[rank][0].endswith("skipped samples: missing_audio 1")
               for rank in (0, 1))
    assert output.count("skipped samples:") == 1  # the console: rank 0's summary only


def test_fsdp2_shards_the_draft_over_both_ranks(straight):
    """Each rank's log says what its parameters hold: DTensors, and half of the elements each (DDP, or an
    FSDP2 that silently replicated, logs no such line or the whole count)."""
    run_dir, _, _ = straight
    held, totals = [], set()
    for rank in (0, 1):
        log_file = next(run_dir.rglob(f"dflash_train_rank{rank}.log"))
        match = re.search(r"draft sharded over (\d+) ranks: (\d+) of (\d+) parameters are DTensors; "
                          r"this rank holds (\d+) of (\d+) elements; reshard_after_forward=true", log_file.read_text())
        assert match, f"rank {rank} did not shard the draft"
        ranks, dtensors, params, local, total = map(int, match.groups())
        assert ranks == 2 and dtensors == params > 0
        held.append(local)
        totals.add(total)
    (total,) = totals
    assert sum(held) == total and max(held) <= total // 2 + 64 * 16  # dim-0 shards: at most one row apart


def test_the_target_is_hashed_once_on_rank_zero_and_both_ranks_hold_its_digest(straight, tiny_salm_dir):
    """Rank 0 alone reads the target's weights for the checkpoint identity and broadcasts the digest: the
    hashing line is in rank 0's log only, and the checkpoint (written with rank 1 taking part) holds it."""
    from dflash_train.files import sha256_file

    run_dir, _, _ = straight
    lines = {rank: re.findall(r"target weights SHA-256 (\w+)…", next(run_dir.rglob(f"dflash_train_rank{rank}.log")).read_text())
             for rank in (0, 1)}
    digest = sha256_file(tiny_salm_dir / "model.safetensors")
    assert lines == {0: [digest[:16]], 1: []}
    checkpoint = torch.load(next((run_dir / "checkpoints").glob("*.ckpt")), map_location="cpu", weights_only=False)
    assert checkpoint["dflash_train_identity"]["target_weights_sha256"] == digest


def test_a_hybrid_mamba_target_trains_under_fsdp2_on_two_ranks_with_packed_rows(tiny_hybrid_dir, demo_data, tmp_path):
    """The runbook's target family through the recipe users launch: a Nemotron-H SpeechLM (Mamba-2, attention,
    MoE blocks in SALMAutomodel's names) behind torchrun, FSDP2 over 2 ranks, DFlash2, BF16, shuffling
    workers, packed rows (each document runs apart through the Mamba blocks) and serving validation, which
    decodes on the Mamba cache. Both ranks shard, train, validate and the export reloads strictly."""
    from dflash_train.evaluate.loading import load_draft
    from dflash_train.target.load import open_speech_target
    from dflash_train.config.schema import ModelConfig

    train, val = demo_data
    run_dir, exp_dir = tmp_path / "run", tmp_path / "exp"
    output = _run(_launch_command(
        tiny_hybrid_dir, run_dir, exp_dir, train, val,
        "model=salm_automodel", "trainer.max_steps=4", "trainer.val_check_interval=4", "dflash.serving_val_samples=2",
        "dflash.selector_rank=16", "dflash.selector_top_k=8", "data.train_ds.packing=true",
        "data.train_ds.batch_tokens=512", "data.train_ds.use_bucketing=false",
    ))
    assert "Mamba blocks run on PyTorch reference ops" in output
    for rank in (0, 1):
        text = next(run_dir.rglob(f"dflash_train_rank{rank}.log")).read_text()
        assert re.search(r"draft sharded over 2 ranks: (\d+) of \1 parameters are DTensors", text), f"rank {rank}"
    rows = _metrics(run_dir)
    losses = [float(r["train/dflash_loss"]) for r in rows if r.get("train/dflash_loss")]
    assert len(losses) == 4 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert any(r.get("val/serving_mal") for r in rows) and any(r.get("val/dflash_loss") for r in rows)
    target = open_speech_target(ModelConfig(pretrained_name=str(tiny_hybrid_dir)))
    draft = load_draft(str(run_dir / "export"), target, "cpu", "float32")
    assert sum(p.numel() for p in draft.parameters()) > 0


def test_serving_validation_pools_both_ranks_counters_on_three_records(straight, tiny_salm_dir, cuts):
    """val/serving_* of a 2-rank run over 3 serving records (rank 0 decodes 2, rank 1 one: before the
    perception stopped all-reducing audio lengths this aborted) equals dflash-eval's pooled counters on the
    export, decoded in the run's BF16: one rank's counters alone would not match."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import evaluate, prepare

    run_dir, _, _ = straight
    _, val, _ = cuts
    settings, loaded = prepare(TargetSource(checkpoint=str(tiny_salm_dir)), {"draft": str(run_dir / "export")},
                               InputConfig(type="lhotse_as_conversation", cuts_path=str(val)), max_new_tokens=64,
                               dtype="bfloat16", limit=3)
    counters = evaluate(settings, loaded).counters("draft")
    rows = [row for row in _metrics(run_dir) if row.get("val/serving_rounds")]
    assert [int(float(row["step"])) for row in rows] == [4, 8]  # validations at steps 4 and 8
    assert int(float(rows[-1]["val/serving_rounds"])) == counters.rounds > 0
    assert int(float(rows[-1]["val/serving_failed"])) == 0
    summaries = rank_log_lines(run_dir, f"steps: {STEPS};")
    assert all(len(summaries[rank]) == 1 and summaries[rank][0].endswith(f"serving MAL {counters.mal:.4f}")
               for rank in (0, 1))


def test_the_checkpoint_holds_the_round_starts_both_ranks_mined(straight):
    """Serving-aware anchors: each rank mines its own rows (steps 0, 2, 4, 6); the checkpoint rank 0 writes
    must hold both ranks' memories, or a resumed rank would forget its own."""
    from dflash_train.training.serving_anchors import CHECKPOINT_KEY

    run_dir, _, _ = straight
    mined = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[CHECKPOINT_KEY]
    for rank in (0, 1):
        rows = [r for r in _sample_log(run_dir, rank) if r["split"] == "train" and r["step"] in (0, 2, 4, 6)]
        assert {i for r in rows for i in r["ids"]} <= set(mined), rank


def test_all_ranks_share_one_hydra_run_directory_inside_the_run_directory(straight):
    run_dir, exp_dir, _ = straight
    launches = list((run_dir / "hydra").iterdir())
    assert len(launches) == 1, launches
    assert not exp_dir.exists() or not any(exp_dir.rglob("*.log")), "Hydra logs outside the run directory"
    assert sorted(p.name for p in launches[0].glob("*.log")) == ["dflash_train_rank0.log", "dflash_train_rank1.log"]


# ---------------------------------------------------------------- preemption and resume


def _rank_processes(launcher_pid: int) -> list[int]:
    """The worker processes torchrun started (its direct children)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid:
            children.append(int(stat.parent.name))
    return children


def _preempt(command: list[str], log_path: Path, signum: int) -> str:
    """Run ``command`` until both ranks passed step 2, then send ``signum`` as the scheduler does: SIGTERM to
    torchrun (which passes it on), SIGUSR1 to each rank process (SLURM's ``--signal`` with ``srun`` starting
    the ranks; torchrun itself would die of it)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while "step 2/" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.05)
            if signum == signal.SIGTERM:
                proc.send_signal(signum)
            else:
                ranks = _rank_processes(proc.pid)
                assert len(ranks) == 2, ranks
                for pid in ranks:
                    os.kill(pid, signum)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return log_path.read_text()


def _check_preempted_then_resume(output: str, signame: str, command: list[str], run_dir: Path) -> int:
    notes = rank_log_lines(run_dir, f"preempted by {signame} at step")
    assert [len(notes.get(rank, [])) for rank in (0, 1)] == [1, 1], output[-4000:]  # both ranks stopped
    stopped = {int(notes[rank][0].split("at step ")[1].split(":")[0]) for rank in (0, 1)}
    assert len(stopped) == 1, notes  # at the same step
    stopped_at = stopped.pop()
    assert 2 <= stopped_at < STEPS
    # the uninterrupted run does not validate at the stop step (unless scheduled) and the grace period is short
    assert f"validation at step {stopped_at}:" not in output, "the preempted launch validated before stopping"
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stopped_at
    # FSDP2 saves one consolidated checkpoint: every draft parameter whole (not one rank's shard)
    prefix = "core.draft_model."
    draft_shapes = {k.removeprefix(prefix): tuple(v.shape) for k, v in ckpt["state_dict"].items()
                    if k.startswith(prefix)}
    assert not (run_dir / "export").exists()
    resumed = _run(command)
    assert f"resumed from {run_dir / 'checkpoints' / 'last.ckpt'} at global step {stopped_at}" in resumed
    exported = _export_weights(run_dir)
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: draft_shapes.get(k) for k in exported}
    return stopped_at


def test_sigterm_under_fsdp2_with_workers_resumes_to_the_uninterrupted_weights(straight, tiny_salm_dir, cuts,
                                                                                tmp_path):
    run_dir = tmp_path / "run"
    command = _command(tiny_salm_dir, cuts, run_dir, tmp_path / "exp")
    output = _preempt(command, tmp_path / "preempted.log", signal.SIGTERM)
    stopped_at = _check_preempted_then_resume(output, "SIGTERM", command, run_dir)
    worst = worst_difference(_export_weights(run_dir), _export_weights(straight[0]))
    print(f"\nSIGTERM at step {stopped_at} + resume vs uninterrupted (FSDP2, 2 workers, bf16): max |dw| = {worst:.3g}")
    assert worst == 0.0  # same ops on the same data in the same order: bit-equal


ACCUMULATE = "trainer.accumulate_grad_batches=2"


def test_sigusr1_with_gradient_accumulation_resumes_to_the_uninterrupted_weights(tiny_salm_dir, cuts, tmp_path):
    """Two ranks accumulating two micro-batches per step: SIGUSR1 to each rank mid-run, resume, and the
    weights equal an uninterrupted run's (the data position, the micro-batch phase and the window's
    normalisation all survive the restart)."""
    straight_dir = tmp_path / "straight"
    _run(_command(tiny_salm_dir, cuts, straight_dir, tmp_path / "exp0", ACCUMULATE))
    steps = [int(float(r["step"])) for r in _metrics(straight_dir) if r.get("train/dflash_loss")]
    assert steps == list(range(1, STEPS + 1))  # one row per optimizer step of two micro-batches, at its step
    run_dir = tmp_path / "run"
    command = _command(tiny_salm_dir, cuts, run_dir, tmp_path / "exp1", ACCUMULATE)
    output = _preempt(command, tmp_path / "preempted.log", signal.SIGUSR1)
    stopped_at = _check_preempted_then_resume(output, "SIGUSR1", command, run_dir)
    worst = worst_difference(_export_weights(run_dir), _export_weights(straight_dir))
    print(f"\nSIGUSR1 at step {stopped_at} + resume vs uninterrupted (accumulate 2): max |dw| = {worst:.3g}")
    assert worst == 0.0


# ---------------------------------------------------------------- collectives that depend on a rank's data


@pytest.fixture(scope="module")
def uneven(demo_data, tmp_path_factory) -> tuple[Path, Path, dict]:
    """Training conversations where rank 0's shard is text only and rank 1's is speech, and validation
    records whose only one for rank 1 (index 1) has no audio file."""
    train, val = demo_data
    root = tmp_path_factory.mktemp("uneven")
    lines = []
    for index, record in enumerate(_records(train)[:12]):
        reply = {"from": "Assistant", "type": "text", "value": record["supervisions"][0]["text"]}
        if index % 2 == 0:
            user = {"from": "User", "type": "text", "value": "Repeat after me: " + reply["value"]}
            lines.append({"id": f"text-{index}", "conversations": [user, reply]})
        else:
            audio = record["recording"]["sources"][0]["source"]
            user = {"from": "User", "type": "audio", "value": audio, "duration": record["duration"]}
            lines.append({"id": f"speech-{index}", "conversations": [user, reply]})
    conversations = root / "conversations.jsonl"
    conversations.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = _records(val)[:3]
    records[1] = _broken(records[1], "unreadable-serving-record", root / "missing.wav")
    val_cuts = _write_records(root / "val_cuts.jsonl.gz", records)
    return conversations, val_cuts, {"text": [line["id"] for line in lines[0::2]]}


def test_text_only_batches_and_a_rank_without_readable_serving_records_keep_collectives_in_step(
        uneven, tiny_salm_dir, tmp_path):
    """Rank 0 trains on text only (its encoder never runs), rank 1 on speech; at validation rank 1's only
    serving record is unreadable. Every rank runs the same collectives, the run finishes, and the pooled
    counters say what happened: 1 failed serving record, rank 0's rounds only."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import evaluate, prepare

    conversations, val, ids = uneven
    run_dir = tmp_path / "run"
    command = _launch_command(
        tiny_salm_dir, run_dir, tmp_path / "exp", Path("unused"), val,
        "data.train_ds.input_cfg=[{type:multimodal_conversation,manifest_filepath:'" + str(conversations) + "'}]",
        "trainer.max_steps=4", "trainer.val_check_interval=2", "dflash.serving_val_samples=3",
    )
    _run(command)
    rank0 = {i for r in _sample_log(run_dir, 0) if r["split"] == "train" for i in r["ids"]}
    rank1 = {i for r in _sample_log(run_dir, 1) if r["split"] == "train" for i in r["ids"]}
    assert rank0 and rank0 <= set(ids["text"]) and rank1 and not rank1 & set(ids["text"])
    settings, loaded = prepare(TargetSource(checkpoint=str(tiny_salm_dir)), {"draft": str(run_dir / "export")},
                               InputConfig(type="lhotse_as_conversation", cuts_path=str(val)), max_new_tokens=64,
                               dtype="bfloat16", limit=3)
    result = evaluate(settings, loaded)
    counters = result.counters("draft")
    last = [row for row in _metrics(run_dir) if row.get("val/serving_rounds")][-1]
    assert int(float(last["val/serving_failed"])) == 1
    assert int(float(last["val/serving_rounds"])) == counters.rounds > 0
    summaries = rank_log_lines(run_dir, "steps: 4;")
    assert all(len(summaries[rank]) == 1 and summaries[rank][0].endswith(f"serving MAL {counters.mal:.4f}")
               for rank in (0, 1))


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
