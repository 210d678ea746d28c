"""Work left in the training process per batch: sampler in the main process vs in the loader's workers.

    .venv/bin/python benchmarks/loader_main_process.py [--batches 40] [--rounds 2] [--out FILE.json]

Until the loader moved the lhotse sampler into its workers (``dflash_train.data.loader``), the
training process ran the sampler of a map-style ``DataLoader``: it read every record, tokenized it
and opened its audio (the header, or the whole clip for float audio, which is checked for
non-finite samples) between training steps, and only the audio decoding for training went to the
workers. This measures the CPU time of the training process's main thread (``time.thread_time``)
per training batch for both designs, on the same data module (the tiny real SALM's tokenizer and
exact audio estimator, real espeak-ng speech), the same sampler settings and two workers each: the
"main-process sampler" loader is that design rebuilt here (``DataLoader(sampler=...)`` over the
same sampler and collator), the "worker sampler" one is the data module's own training loader. Each design's loader starts (its
workers fork and fill their prefetch) before the timed batches; rounds alternate the designs so
machine noise hits both. Audio as 16-bit WAV and as float32 WAV.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import soundfile
import torch
from lhotse import CutSet, Recording
from torch.utils.data import DataLoader, Dataset

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.collate import SpeechCollator
from dflash_train.data.module import SpeechDataModule
from dflash_train.data.sampling import build_sampler, train_shuffle

TAG = "<|audio|>"
SPLIT = dict(batch_tokens=1024, max_tokens=160, use_bucketing=True, num_buckets=4, bucket_estimate_samples=64,
             bucket_buffer_size=64, shuffle_buffer_size=64, num_workers=2)


class _CollateEachSampledBatch(Dataset):
    """The earlier design's map-style dataset: the sampler's batch (prepared in the main process) is the index."""

    def __init__(self, collate: SpeechCollator):
        self.collate = collate

    def __getitem__(self, examples):
        return self.collate(examples)


def _main_process_sampler(module: SpeechDataModule) -> DataLoader:
    ds = module.cfg.train_ds
    sampler = build_sampler(module.train_examples(), ds, train_shuffle(ds), module.train_seed, 0, 1)
    collate = SpeechCollator(module.pad_id, module.prompt_format.audio_locator_tag_id, ds.packing, "train")
    return DataLoader(_CollateEachSampledBatch(collate), sampler=sampler, batch_size=None, num_workers=ds.num_workers,
                      persistent_workers=True, pin_memory=False)


DESIGNS = {"main-process sampler": _main_process_sampler, "worker sampler": SpeechDataModule.train_dataloader}


def _float_copy(cuts_path: Path, out: Path) -> Path:
    """The same cuts with their audio rewritten as float32 WAV."""
    out.mkdir(parents=True, exist_ok=True)
    cuts = []
    for cut in CutSet.from_file(cuts_path):
        audio, rate = soundfile.read(cut.recording.sources[0].source, dtype="float32")
        path = out / f"{cut.id}.wav"
        soundfile.write(path, audio, rate, subtype="FLOAT")
        cut.recording = Recording.from_file(path, recording_id=cut.recording.id)
        cuts.append(cut)
    manifest = out / "cuts.jsonl.gz"
    CutSet(cuts).to_file(manifest)
    return manifest


def _per_batch(loader: DataLoader, batches: int) -> tuple[float, float]:
    """Main-thread CPU ms and wall ms per batch over ``batches`` batches, after the loader has started."""
    it = iter(loader)
    for _ in range(4):  # workers forked, prefetch filled
        next(it)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.thread_time() - cpu) * 1e3 / batches, (time.perf_counter() - wall) * 1e3 / batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from nemo.collections.speechlm2.models import SALM

    from dflash_train.data.estimator import AudioTokenEstimator
    from dflash_train.target import SALMTarget
    from dflash_train.testing.demo_data import write_demo_data
    from dflash_train.testing.tiny_salm import build_tiny_salm

    work = Path(tempfile.mkdtemp(prefix="loader-bench-"))
    target = SALMTarget(SALM.from_pretrained(str(build_tiny_salm(work / "target"))))
    estimator = AudioTokenEstimator.from_target(target)
    train, _ = write_demo_data(work / "data", count=96, val_count=8, jobs=2)
    audio = {"int16 wav": train, "float32 wav": _float_copy(train, work / "float")}

    results = []
    for audio_kind, cuts in audio.items():
        cfg = DataConfig(train_ds=DatasetConfig(
            input_cfg=[InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts))], **SPLIT))
        samples = {name: [] for name in DESIGNS}
        for _ in range(args.rounds):
            for name, build in DESIGNS.items():
                module = SpeechDataModule(cfg, target.tokenizer, TAG, estimator, seed=0, rank=0, world_size=1)
                samples[name].append(_per_batch(build(module), args.batches))
        for name, runs in samples.items():
            row = {"audio": audio_kind, "design": name,
                   "main_thread_cpu_ms_per_batch": round(statistics.median(r[0] for r in runs), 2),
                   "wall_ms_per_batch": round(statistics.median(r[1] for r in runs), 2),
                   "rounds": [[round(c, 2), round(w, 2)] for c, w in runs]}
            results.append(row)
            print(json.dumps(row))
    report = {"batches": args.batches, "rounds": args.rounds, "workers": SPLIT["num_workers"],
              "batch_tokens": SPLIT["batch_tokens"], "rows": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
