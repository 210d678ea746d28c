"""Step time of the Lightning module vs a bare loop over the same trainer core, and step memory.

    .venv/bin/python benchmarks/step_time.py [--steps 20] [--rounds 3]

Both paths run in one process on the same tiny real SALM target, batch (real espeak-ng
speech) and freshly built draft: splice audio, tap the target, take target-argmax labels, run
nemo_automodel's DFlash2 trainer core, backward, AdamW step. Rounds alternate the two paths
so machine noise hits both; the ratio of medians is the overhead of our module + Lightning.
Then, in fresh subprocesses, the peak resident memory a step adds as num_anchors grows.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

TEXTS = [
    "hello world",
    "the draft proposes tokens and the target checks them",
    "a small speech model listens to the clip and writes down every word it hears",
]


def _setup(work: Path, num_anchors: int, repeat: int = 4):
    from conftest import chatml_speech_batch
    from lhotse import CutSet, Recording
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.draft import DraftSpec, build_draft
    from dflash_train.target import SALMTarget
    from dflash_train.testing.speech import synthesize
    from dflash_train.testing.tiny_salm import build_tiny_salm
    from dflash_train.variants import DFlash2Config

    salm_dir = work / "salm"
    if not (salm_dir / "model.safetensors").exists():
        build_tiny_salm(salm_dir)
    wavs = [synthesize(t, work / f"{i}.wav") for i, t in enumerate(TEXTS)]
    cuts = CutSet([Recording.from_file(str(w), recording_id=f"r{i}").to_cut() for i, w in enumerate(wavs)])
    audios, lens = cuts.load_audio(collate=True)
    target = SALMTarget(SALM.from_pretrained(str(salm_dir)))
    batch = chatml_speech_batch(target, (torch.as_tensor(audios), torch.as_tensor(lens)), TEXTS, repeat=repeat)
    cfg = DFlash2Config(draft_num_hidden_layers=2, block_size=8, num_anchors=num_anchors, selector_rank=32)
    spec = DraftSpec(cfg, (1, 3), 320, target.num_layers)
    return target, batch, spec, lambda: build_draft(target.llm_config, spec, "sdpa")


def bare_loop(target, batch, spec, make_draft, steps: int) -> list[float]:
    """The same work as one training step, with no Lightning and no module."""
    from dflash_train.training.module import DFlashDraftModule, ModuleSettings

    module = DFlashDraftModule(target, make_draft(), spec, ModuleSettings(layer_ids=[1, 3]))
    optimizer = torch.optim.AdamW(module.trainable_parameters(), lr=6e-4)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        # the module's own input preparation and core call, so both paths do identical work
        metrics = module.run_core(module.prepare(batch), step)
        metrics.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times


def lightning_loop(target, batch, spec, make_draft, steps: int, work: Path) -> list[float]:
    """Our module under ``lightning.Trainer`` (manual optimisation, logging, checkpoint-free)."""
    import lightning as L
    from listdata import ListDataModule

    from dflash_train.training.module import DFlashDraftModule, ModuleSettings

    class StepTimer(L.Callback):
        def __init__(self):
            self.times, self._started = [], 0.0

        def on_train_batch_start(self, *args):
            self._started = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self._started)

    timer = StepTimer()
    module = DFlashDraftModule(target, make_draft(), spec, ModuleSettings(layer_ids=[1, 3]))
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
        default_root_dir=str(work),
    )
    trainer.fit(module, datamodule=ListDataModule([batch], [batch]))
    return timer.times


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def memory_probe(num_anchors: int, steps: int) -> None:
    """Subprocess body: print the peak resident memory above the pre-step level during training steps (MiB)."""
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        target, batch, spec, make_draft = _setup(Path(tmp), num_anchors, repeat=24)  # > 512 anchor candidates per row
        bare_loop(target, batch, spec, make_draft, 1)  # warm-up: allocator and kernels
        before = _resident_mib()
        peak, done = [before], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _resident_mib())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        bare_loop(target, batch, spec, make_draft, steps)
        done.set()
        sampler.join()
        print(json.dumps({"num_anchors": num_anchors, "step_peak_mib": peak[0] - before}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-probe", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_probe:
        memory_probe(args.memory_probe, 3)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target, batch, spec, make_draft = _setup(work, 512)
        bare_loop(target, batch, spec, make_draft, 2)  # warm-up
        bare, lit = [], []
        for _ in range(args.rounds):
            bare += bare_loop(target, batch, spec, make_draft, args.steps)[1:]
            lit += lightning_loop(target, batch, spec, make_draft, args.steps, work)[1:]
    b, m = statistics.median(bare), statistics.median(lit)
    print(f"step time, median of {len(bare)} steps each (1 thread, tiny SALM, DFlash2, B=8, 512 anchors):")
    print(f"  bare loop over the trainer core : {b * 1000:7.1f} ms")
    print(f"  DFlashDraftModule + Lightning   : {m * 1000:7.1f} ms")
    print(f"  ratio (module / bare)           : {m / b:7.3f}   (goal <= 1.10)")
    print("peak resident memory above the pre-step level during 3 steps (fresh process per setting):")
    for anchors in (128, 256, 512):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-probe", str(anchors)], capture_output=True, text=True, check=True
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  num_anchors={anchors:4d}: {row['step_peak_mib']:7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
