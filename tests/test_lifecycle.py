"""A run as a cluster runs it, through the real CLI: stopped, requeued and resumed (three launches), re-run after
it finished, and relaunched with too few steps. The resumed run validates on the uninterrupted run's steps, logs
its values, and its export records them; one step numbering everywhere; every file under the run directory.

The runs export their best validated checkpoint (``exp_manager.export_checkpoint=best``) and their learning rate
jumps a hundredfold after step 4, which spoils the draft: the last step validates worse than an earlier one, and
the export (of the uninterrupted run and of the resumed one, whose best step came before a resume) is that
earlier step, with its logged figures and its checkpoint's weights."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

import torch
from conftest import Launch, free_port
from safetensors.torch import load_file

from dflash_train.config.metrics import validation_metrics
from dflash_train.config.validate import read_resolved_config
from dflash_train.training.history import read_history

STEPS, EVERY = 6, 2
LAUNCHES = (2, 4, 6)  # max_steps of the resumed run's launches: stopped at 2 and 4 (a requeue), finished at 6
VALIDATED = [2, 4, 6]
SPOILED_AFTER_STEP_4 = "dflash.lr_scheduler={_target_:torch.optim.lr_scheduler.MultiStepLR,milestones:[4],gamma:100.0}"
# the tiny target's DFlash2 serving MAL is 1.0 at every step (nothing to choose); MTP's differs, so MTP's runs
# monitor what serving prefers
MONITOR = {"dflash2": "val/accept_len", "mtp": "val/serving_mal"}


def _start(args, cwd) -> Launch:
    """``python -m dflash_train`` with ``args`` in ``cwd``, started (``Launch.finish`` awaits it). Each launch has a
    rendezvous port of its own: the uninterrupted run trains beside the resumed run's launches."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    return Launch([sys.executable, "-m", "dflash_train", *args], env, cwd)


def _finish(launch: Launch):
    proc = launch.finish(600)
    return proc.returncode, proc.stdout + proc.stderr


def _train(args, cwd):
    return _finish(_start(args, cwd))


def _common(salm_dir, demo_data, variant):
    train_cuts, val_cuts = demo_data
    return [
        "--config-name=demo", f"dflash={variant}", f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20", f"trainer.val_check_interval={EVERY}",
        "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "dflash.serving_val_samples=2",
        "dflash.serving_val_max_new_tokens=8", "exp_manager.resume_if_exists=true", SPOILED_AFTER_STEP_4,
        f"exp_manager.checkpoint_monitor={MONITOR[variant]}", "exp_manager.export_checkpoint=best",
    ]


class Runs:
    """One uninterrupted run (``explicit_log_dir``) and the same run in three launches (``exp_dir``/``name``),
    each launched from its own empty working directory. The uninterrupted run trains beside the three launches
    (one process each, on one core: the two sequences share nothing but the target and the data, read only)."""

    def __init__(self, root: Path, salm_dir, demo_data, variant: str, launches=LAUNCHES):
        self.root, self.common, self.launches = root, _common(salm_dir, demo_data, variant), launches
        self.monitor = MONITOR[variant]
        self.straight = root / "straight"
        self.exp_dir = root / "exp"
        self.resumed = self.exp_dir / "resumed"
        with _start(self.common + [f"trainer.max_steps={STEPS}", f"exp_manager.explicit_log_dir={self.straight}"],
                    self._cwd("cwd0")) as straight:
            self.resumed_logs = []
            for i, steps in enumerate(launches):
                code, out = self.launch(f"cwd{i + 1}", *self.resumed_args(steps))
                assert code == 0, out[-4000:]
                self.resumed_logs.append(out)
            code, self.straight_log = _finish(straight)
        assert code == 0, self.straight_log[-4000:]

    def resumed_args(self, steps: int) -> list[str]:
        return [f"trainer.max_steps={steps}", "exp_manager.explicit_log_dir=null", f"exp_manager.exp_dir={self.exp_dir}",
                "exp_manager.name=resumed"]

    def launch(self, cwd_name: str, *args: str):
        return _train(self.common + list(args), self._cwd(cwd_name))

    def _cwd(self, name: str) -> Path:
        cwd = self.root / name
        cwd.mkdir()
        return cwd


def _validation_steps(log: str) -> list[int]:
    """The steps a launch's console says it validated at."""
    return [int(s) for s in re.findall(r"validation at step (\d+):", log)]


def _training_info(run_dir: Path) -> dict:
    return json.loads((run_dir / "export" / "config.json").read_text())["training_info"]


def _check_resumed_equals_straight(runs: Runs) -> None:
    """Validated on the same steps with the same values, recorded the same in the export; one numbering."""
    assert _validation_steps(runs.straight_log) == VALIDATED
    validated = [_validation_steps(log) for log in runs.resumed_logs]
    starts = (0,) + tuple(runs.launches[:-1])
    # each launch validates its own scheduled steps; one resuming from a checkpoint written at a validation step
    # validates that step first (the launch that wrote it may have stopped before validating: preempted, killed)
    expected = [[s for s in VALIDATED if start <= s <= end and s > 0] for start, end in zip(starts, runs.launches)]
    assert validated == expected, f"the launches validated at {validated}"
    lines = [re.findall(r"validation at step \d+: .*", log) for log in runs.resumed_logs]
    repeated = [(a[-1], b[0]) for a, b in zip(lines, lines[1:])]
    assert all(before == again for before, again in repeated), f"a repeated validation differs: {repeated}"
    straight, resumed = read_history(runs.straight), read_history(runs.resumed)
    for name in ("val/accept_len", "val/serving_mal", "val/dflash_loss"):
        assert resumed.get(name).steps == straight.get(name).steps == tuple(VALIDATED), name
        assert resumed.get(name).values == straight.get(name).values, name
    assert resumed.get("train/dflash_loss").steps == tuple(range(1, STEPS + 1))
    info, straight_info = _training_info(runs.resumed), _training_info(runs.straight)
    for key in ("global_step", "trained_steps", "val_step", "val_accept_len", "val_serving_mal", "exported_checkpoint"):
        assert info[key] == straight_info[key], key
    _check_the_export_is_the_best_validated_step(runs.straight, straight, runs.monitor)
    _check_the_export_is_the_best_validated_step(runs.resumed, resumed, runs.monitor)
    assert (f"export: {runs.resumed / 'export'} (the best validated checkpoint by {runs.monitor} (max): step "
            f"{info['global_step']}, ") in runs.resumed_logs[-1]
    # what a monitor may name (checked before any weight loads) is what validation logs
    run = read_resolved_config(runs.straight / "resolved_config.yaml")
    assert sorted(validation_metrics(run)) == sorted(name for name in straight.series if name.startswith("val"))
    assert straight_info["start_step"] == 0
    assert info["start_step"] == runs.launches[-2] == json.loads((runs.resumed / "run_info.json").read_text())["start_step"]
    assert f"steps: {STEPS};" in runs.resumed_logs[-1]
    report = (runs.resumed / "report.md").read_text()
    assert (f"the weights of step {info['global_step']} (the best validated checkpoint by `{runs.monitor}`, max: "
            f"{info['exported_checkpoint']['score']:.4f}).") in report
    resumes = ", ".join(str(s) for s in runs.launches[:-1])
    assert f"last logged step {STEPS}; {len(runs.launches)} launches (resumed at step {resumes})" in report
    table = report.split("| step | val loss |")[1].split("\n\n")[0]
    assert [int(s) for s in re.findall(r"^\| (\d+) \|", table, re.M)] == VALIDATED
    best = [int(m.group(1)) for p in (runs.resumed / "checkpoints").iterdir() if (m := re.match(r"best-step=(\d+)-", p.name))]
    assert best and set(best) <= set(VALIDATED), best


def _draft_state(checkpoint: Path) -> dict:
    state = torch.load(str(checkpoint), map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("core.draft_model."): v for k, v in state.items() if k.startswith("core.draft_model.")}


def _export_holds(export_dir: Path, variant: str, state: dict) -> bool:
    """Whether the export's weights are ``state`` (a draft state dict) in the variant's serving names."""
    if variant == "mtp":
        from dflash_train.draft.mtp import MTPStep

        expected = MTPStep.from_checkpoint(export_dir)[0].checkpoint_state(state)
    else:
        from dflash_train.draft.export import export_state_dict

        expected = export_state_dict(state)
    exported = load_file(str(export_dir / "model.safetensors"))
    return all(torch.equal(exported[name], tensor) for name, tensor in expected.items())


def _check_the_export_is_the_best_validated_step(run_dir: Path, history, monitor: str) -> None:
    """The export holds the step that validated best on ``monitor`` (the earliest of equals), which is not the
    last one; it records that step's logged figures, and its weights are that checkpoint's draft."""
    curve = history.get(monitor)
    at = max(range(len(curve.steps)), key=lambda i: (curve.values[i], -i))
    best = curve.steps[at]
    assert best < STEPS and curve.values[-1] < curve.values[at], f"the last step validated best: {curve}"
    info = _training_info(run_dir)
    chosen = info["exported_checkpoint"]
    assert chosen == {"choice": "best", "monitor": monitor, "mode": "max", "score": curve.values[at],
                      "checkpoint": chosen.get("checkpoint")}, chosen
    assert (info["trained_steps"], info["global_step"], info["val_step"]) == (STEPS, best, best), info
    assert info["val_accept_len"] == history.get("val/accept_len").values[at]
    assert info["val_serving_mal"] == history.get("val/serving_mal").values[at]
    checkpoint = run_dir / "checkpoints" / chosen["checkpoint"]
    assert chosen["checkpoint"].startswith(f"best-step={best}-"), chosen
    variant = json.loads((run_dir / "run_info.json").read_text())["variant"]
    assert _export_holds(run_dir / "export", variant, _draft_state(checkpoint))
    assert not _export_holds(run_dir / "export", variant, _draft_state(run_dir / "checkpoints" / "last.ckpt"))


def _check_everything_under_the_run_directory(runs: Runs) -> None:
    """Hydra's per-rank logs of every launch are in the run's own directory; nothing in a working directory,
    ``./outputs`` or beside the run."""
    for run_dir, launches in ((runs.straight, 1), (runs.resumed, len(runs.resumed_logs))):
        logs = sorted((run_dir / "hydra").glob("*/dflash_train_rank0.log"))
        assert len(logs) >= launches, f"{run_dir}: {len(logs)} Hydra logs for {launches} launches"
    assert sorted(p.name for p in runs.exp_dir.iterdir()) == ["resumed"]
    for cwd in runs.root.glob("cwd*"):
        assert list(cwd.iterdir()) == [], f"{cwd} holds {list(cwd.iterdir())}"


def _snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in run_dir.rglob("*") if p.is_file() and "hydra" not in p.relative_to(run_dir).parts}


@pytest.fixture(scope="module")
def dflash2_runs(tiny_salm_dir, demo_data, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dflash2"), tiny_salm_dir, demo_data, "dflash2")


def test_a_requeued_dflash2_run_validates_and_records_what_the_uninterrupted_run_does(dflash2_runs):
    _check_resumed_equals_straight(dflash2_runs)
    _check_everything_under_the_run_directory(dflash2_runs)


def test_rerunning_a_finished_run_says_so_and_changes_nothing_and_fewer_steps_is_one_line(dflash2_runs):
    runs = dflash2_runs
    before = _snapshot(runs.resumed)
    code, out = runs.launch("cwd-again", *runs.resumed_args(STEPS))
    assert code == 0, out[-4000:]
    info = _training_info(runs.resumed)
    assert f"finished: the run reached trainer.max_steps={STEPS}; nothing to do" in out
    best = info["val_step"]
    assert (f"export: {runs.resumed / 'export'} (step {STEPS}, the best by val/accept_len: step {best}; recorded "
            f"val_step {best}, val_accept_len {info['val_accept_len']:.4f}, val_serving_mal "
            f"{info['val_serving_mal']:.4f})") in out
    assert "vllm serve" in out and "no final export" not in out
    code, out = runs.launch("cwd-fewer", *runs.resumed_args(STEPS - 1))
    assert code == 1 and out.strip().splitlines()[-1] == (
        f"config error: trainer.max_steps={STEPS - 1} is below step {STEPS}, where "
        f"{runs.resumed / 'checkpoints' / 'last.ckpt'} resumes the run: set trainer.max_steps >= {STEPS}, or start a "
        "new run (another exp_manager.explicit_log_dir, or exp_manager.resume_if_exists=false)")
    assert _snapshot(runs.resumed) == before, "a finished run's files changed"


def test_a_requeued_mtp_run_validates_and_records_what_the_uninterrupted_run_does(tiny_salm_dir, demo_data, tmp_path):
    _check_resumed_equals_straight(Runs(tmp_path, tiny_salm_dir, demo_data, "mtp", launches=(2, STEPS)))
