"""Shared fixtures: one tiny real SALM target and a few real spoken utterances per session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent

UTTERANCES = {
    "utt-short": "hello world",
    "utt-mid": "the draft proposes tokens and the target checks them",
    "utt-long": "a small speech model listens to the clip and writes down every word it hears",
}


LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """Each test starts without a default process group or launcher variables another test left behind.

    An in-process Lightning DDP run initialises a process group and sets ``MASTER_PORT`` in
    ``os.environ``; a later test would then fail to create its own group, and a subprocess
    would inherit a port that is still taken.
    """
    saved = {key: os.environ.get(key) for key in LAUNCH_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_salm_dir(tmp_path_factory) -> Path:
    from dflash_train.testing.tiny_salm import build_tiny_salm

    return build_tiny_salm(tmp_path_factory.mktemp("tiny_salm"))


HYBRID_PATTERN = "M*-EM*ME"
"""The tiny Nemotron-H target's blocks: Mamba-2, attention, MLP and MoE, each kind twice or more."""


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory) -> Path:
    """A tiny Nemotron-H SpeechLM in SALMAutomodel's native names (M, *, -, E blocks), the tiny SALM's tokenizer."""
    from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm

    spec = TinyMTPSpec(backbone_pattern=HYBRID_PATTERN, native_names=True)
    return build_tiny_mtp_salm(tmp_path_factory.mktemp("tiny_hybrid") / "target", spec)


@pytest.fixture(scope="session")
def tiny_hybrid_target(tiny_hybrid_dir):
    from dflash_train.config.schema import ModelConfig
    from dflash_train.target import open_speech_target

    return open_speech_target(ModelConfig(pretrained_name=str(tiny_hybrid_dir)))


def load_salm_target(salm_dir):
    """A freshly loaded frozen target of the SALM checkpoint in ``salm_dir`` (NeMo's ``SALM.from_pretrained``)."""
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.target import SALMTarget

    return SALMTarget(SALM.from_pretrained(str(salm_dir)))


@pytest.fixture(scope="session")
def tiny_target(tiny_salm_dir):
    return load_salm_target(tiny_salm_dir)


@pytest.fixture(scope="session")
def speech_files(tmp_path_factory) -> dict[str, Path]:
    from dflash_train.testing.speech import synthesize

    out = tmp_path_factory.mktemp("speech")
    return {uid: synthesize(text, out / f"{uid}.wav") for uid, text in UTTERANCES.items()}


@pytest.fixture(scope="session")
def speech_batch(speech_files):
    """Real audio loaded through lhotse: ``(audios [N, T], audio_lens [N])`` in UTTERANCES order."""
    from lhotse import CutSet, Recording

    cuts = CutSet([Recording.from_file(str(p), recording_id=uid).to_cut() for uid, p in speech_files.items()])
    audios, lens = cuts.load_audio(collate=True)
    return torch.as_tensor(audios), torch.as_tensor(lens)


def compose(config_name: str = "dflash", overrides: list[str] | None = None):
    """Compose a shipped recipe exactly as the CLI does (the package's one composition helper)."""
    from dflash_train.config.compose import compose_config

    return compose_config(config_name, overrides or [])


def worst_difference(ours: dict, ref: dict) -> float:
    """Largest elementwise |ours - ref| over two state dicts of the same names (compared in float32)."""
    assert ours.keys() == ref.keys() and ref, f"compared {len(ours)} against {len(ref)} tensors"
    return max((ours[k].float() - ref[k].float()).abs().max().item() for k in ref)


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖: FP32 summation order moves single near-zero entries, not the tensor."""
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def same_tensors(a: dict, b: dict) -> bool:
    """Two state dicts hold the same names and bit-equal tensors; two empty dicts are an error, not a match."""
    assert a and a.keys() == b.keys(), f"compared {len(a)} against {len(b)} tensors: {sorted(set(a) ^ set(b))[:5]}"
    return all(torch.equal(a[k], b[k]) for k in a)


def demo_recipe(salm_dir, demo_data, run_dir, *overrides: str):
    """The demo recipe on the tiny SALM and the demo speech fixture (fp32, no progress bar), validated:
    what ``dflash-train --config-name=demo`` runs, with the tests' target and data."""
    from dflash_train.config import validate_config

    train_cuts, val_cuts = demo_data
    return validate_config(compose("demo", [
        f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20",
        "trainer.precision=32-true",
        "+trainer.enable_progress_bar=false",
        f"exp_manager.explicit_log_dir={run_dir}",
        *overrides,
    ]))


def tiny_run_overrides(salm_dir) -> list[str]:
    """Overrides that make the main recipe valid for the tiny SALM on CPU."""
    return [
        f"model.pretrained_name={salm_dir}",
        "data.train_ds.input_cfg=[]",
        "trainer.precision=32-true",
        "dflash.draft_num_hidden_layers=2",
    ]


def pad_rows(rows, pad_id: int):
    """Right-pad ``(ids, loss_mask)`` lists into ``(input_ids, loss_mask, lengths)`` tensors."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r_ids, r_loss) in enumerate(rows):
        ids[i, : len(r_ids)] = torch.tensor(r_ids, dtype=torch.long)
        loss[i, : len(r_loss)] = torch.tensor(r_loss, dtype=torch.bool)
    return ids, loss, torch.tensor([len(r) for r, _ in rows])


def chatml_speech_batch(target, speech_batch, texts: list[str], repeat: int = 1):
    """A hand-built ``SpeechBatch``: ChatML prompt with one audio turn, loss on the assistant reply.

    Independent of the data pipeline so module tests pin the batch contract on their own.
    """
    from dflash_train.data.batch import SpeechBatch

    audios, audio_lens = speech_batch
    tok = target.tokenizer
    rows = []
    for text in texts:
        prompt = tok.text_to_ids("<|im_start|>user\nTranscribe: <|audio|><|im_end|>\n<|im_start|>assistant\n")
        reply = tok.text_to_ids((text + " ") * repeat + "<|im_end|>")
        rows.append((prompt + reply, [False] * len(prompt) + [True] * len(reply)))
    ids, loss, lengths = pad_rows(rows, target.pad_id)
    n = len(rows)
    return SpeechBatch(
        input_ids=ids,
        loss_mask=loss,
        lengths=lengths,
        audios=audios[:n],
        audio_lens=audio_lens[:n],
        audios_per_row=[1] * n,
        sample_ids=[f"row-{i}" for i in range(n)],
    )


def two_batches(target, speech_batch) -> tuple[dict, dict]:
    """The exact-resume tests' two ChatML batches of ``UTTERANCES`` on ``target``: 2 copies, then 3 reversed."""
    texts = list(UTTERANCES.values())
    return (chatml_speech_batch(target, speech_batch, texts, repeat=2),
            chatml_speech_batch(target, speech_batch, texts[::-1], repeat=3))


def two_batch_data(target, speech_batch):
    """The exact-resume tests' data on ``target``: training cycles :func:`two_batches`; validation is the second.
    Returns the recipe's datamodule factory ``(run, target) -> ListDataModule``."""
    from listdata import ListDataModule

    first, second = two_batches(target, speech_batch)
    return lambda run, target: ListDataModule([first, second], [second])


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> tuple[Path, Path]:
    """A small synthesized demo dataset: ``(train_cuts, val_cuts)`` lhotse manifests of real espeak-ng speech."""
    from dflash_train.testing.demo_data import write_demo_data

    return write_demo_data(tmp_path_factory.mktemp("demo_data"), count=24, val_count=4, jobs=2)


@pytest.fixture(scope="session")
def audio_estimator(tiny_target):
    """The exact audio token estimator of the tiny SALM target."""
    from dflash_train.data.estimator import AudioTokenEstimator

    return AudioTokenEstimator.from_target(tiny_target)


def rank_log_lines(root: Path, text: str) -> dict[int, list[str]]:
    """Per rank, the lines holding ``text`` in its Hydra log files under ``root`` (every launch there).

    A multi-rank run's console has INFO lines from rank 0 only (cli/console.py); each rank's file keeps all.
    """
    lines: dict[int, list[str]] = {}
    for rank in (0, 1):
        for path in sorted(root.rglob(f"dflash_train_rank{rank}.log")):
            lines.setdefault(rank, []).extend(line for line in path.read_text().splitlines() if text in line)
    return lines


class Launch:
    """A launcher (torchrun, or one ``python -m ...`` process) started in a session of its own, its output in
    temporary files: nothing blocks on a full pipe while the test waits for another launch beside it.

    ``finish`` waits for it; on timeout, and on any way out of ``finish`` (pytest-timeout's interrupt too), the
    whole process group is killed, workers included: killing only torchrun would leave its workers hanging in a
    collective (and holding CPU) after the test has failed.
    """

    def __init__(self, command: list[str], env: dict, cwd=None):
        import subprocess
        import tempfile

        self.command = command
        self._stdout, self._stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=self._stdout, stderr=self._stderr, text=True,
                                     start_new_session=True)

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        """Leaving the block (a failed assertion too) kills a launch nobody awaited."""
        self.kill()

    def kill(self) -> None:
        """Kill the launch's process group if the launcher still runs."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finish(self, timeout: float):
        """Wait for the launch: its ``CompletedProcess`` (a failed test after ``timeout`` seconds)."""
        import subprocess

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            output = self._read()
            pytest.fail(f"{' '.join(self.command[:6])} ... did not finish in {timeout} s:\n"
                        f"{(output.stdout + output.stderr)[-4000:]}")
        finally:
            self.kill()
        return self._read()

    def _read(self):
        import subprocess

        texts = []
        for file in (self._stdout, self._stderr):
            file.seek(0)
            texts.append(file.read())
            file.close()
        return subprocess.CompletedProcess(self.command, self.proc.returncode, *texts)


def run_launchers(commands: list[list[str]], env, timeout: float, cwds=None) -> list:
    """Each command of ``commands`` as a :class:`Launch` (``env``: one environment for all, or a list with one
    per command; ``cwds``: a list of working directories), all started at once (side by side on the test
    machine's cores), then awaited: their ``CompletedProcess`` in order. Any failure kills every launch still
    running. For independent runs only: a one-process run with ``OMP_NUM_THREADS=1`` uses one core, so two of
    them take about the time of one on two cores."""
    envs = env if isinstance(env, list) else [env] * len(commands)
    with contextlib.ExitStack() as stack:
        launches = [stack.enter_context(Launch(command, envs[index], None if cwds is None else cwds[index]))
                    for index, command in enumerate(commands)]
        return [launch.finish(timeout) for launch in launches]


def run_launcher(command: list[str], env: dict, timeout: float):
    """``subprocess.run`` for torchrun: on timeout the whole process group is killed, workers included
    (:class:`Launch`)."""
    return Launch(command, env).finish(timeout)


def free_port() -> int:
    """A TCP port free now: the ``MASTER_PORT`` of a one-process run launched beside another (Lightning's own
    pick races: EADDRINUSE)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ResumeComparison:
    """The exact-resume harness: one run straight to ``steps``, one stopped at ``stop_at`` and resumed to
    ``steps`` in its own directory (``run(run_dir, steps)`` trains and returns its ``TrainResult``)."""

    def __init__(self, run, root: Path, steps: int, stop_at: int):
        from safetensors.torch import load_file

        self.straight = run(root / "straight", steps)
        self.stopped = run(root / "resumed", stop_at)
        self.at_stop = load_file(str(self.stopped.export_dir / "model.safetensors"))
        self.resumed = run(root / "resumed", steps)
        assert (self.straight.steps, self.stopped.steps, self.resumed.steps) == (steps, stop_at, steps)
        assert self.resumed.resumed_from == root / "resumed" / "checkpoints" / "last.ckpt"
        self.straight_weights = load_file(str(self.straight.export_dir / "model.safetensors"))
        self.resumed_weights = load_file(str(self.resumed.export_dir / "model.safetensors"))

    def worst(self, keys=None) -> float:
        """Largest weight difference, resumed vs straight, over ``keys`` (default: every exported tensor); it
        also checks that the steps after the stop trained those tensors."""
        keys = sorted(keys if keys is not None else self.straight_weights)
        assert keys and self.resumed_weights.keys() == self.straight_weights.keys()
        assert any(not torch.equal(self.straight_weights[k], self.at_stop[k]) for k in keys), "the resumed steps did not train"
        return worst_difference({k: self.resumed_weights[k] for k in keys}, {k: self.straight_weights[k] for k in keys})


def run_cli_rows(root: Path, rows: list) -> dict:
    """Every ``[name, argv]`` row through ``dflash-train``'s real entry point in one driver process
    (tests/train_cli_rows.py, run in ``root``): ``{name: {"code", "stdout", "stderr"}}``."""
    import json
    import subprocess
    import sys

    (root / "rows.json").write_text(json.dumps(rows))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("HYDRA_FULL_ERROR", None)
    driver = Path(__file__).parent / "train_cli_rows.py"
    proc = subprocess.run([sys.executable, str(driver), str(root / "rows.json"), str(root / "results.json")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "results.json").read_text())
