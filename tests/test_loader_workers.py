"""The loader's workers do the per-sample work: sampling, tokenizing, header checks and decoding.

Each worker walks the sampler and collates every W-th batch (``dflash_train.data.loader``). These
tests hold the training process to doing none of that work after start-up, the batches to be the
same for any worker count (resume and validation dealing included), the skip counts to stay exact,
and an error raised in a worker to reach the user as its one line.
"""

import os
import subprocess
import sys
from itertools import islice
from types import SimpleNamespace

import pytest
import soundfile
import torch
from lhotse import CutSet

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.conversation import DataError
from dflash_train.data.examples import Preparer
from dflash_train.data.module import SpeechDataModule

TAG = "<|audio|>"
SPLIT = dict(batch_tokens=400, max_tokens=140, bucket_buffer_size=40, shuffle_buffer_size=40,
             bucket_estimate_samples=40, num_buckets=3)


def _cuts(path) -> InputConfig:
    return InputConfig(type="lhotse_as_conversation", cuts_path=str(path))


def _module(target, estimator, train, val=None, workers=0, rank=0, world_size=1, **split) -> SpeechDataModule:
    split = {**SPLIT, "num_workers": workers, **split}
    cfg = DataConfig(train_ds=DatasetConfig(input_cfg=train, **split),
                     validation_ds=DatasetConfig(input_cfg=val, **split) if val else None)
    return SpeechDataModule(cfg, target.tokenizer, TAG, estimator, seed=5, rank=rank, world_size=world_size)


def _resumed_after(module: SpeechDataModule, batches: int) -> SpeechDataModule:
    progress = SimpleNamespace(total=SimpleNamespace(processed=batches))
    module.trainer = SimpleNamespace(global_rank=module._requested_topology[0] or 0,
                                     world_size=module._requested_topology[1] or 1,
                                     fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    return module


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_training_process_prepares_no_sample_after_start_up(tiny_target, audio_estimator, demo_data,
                                                                 monkeypatch):
    """Preparing (tokenizing), header reads and audio decoding happen in workers; in this process they
    are counted (a worker's calls land in its own copy of the counter)."""
    from lhotse.cut import MonoCut

    counters = {}
    for workers in (0, 2):
        loader = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], workers=workers).train_dataloader()
        calls = {"prepare": _count_calls(monkeypatch, Preparer, "__call__"),
                 "header": _count_calls(monkeypatch, soundfile, "info"),
                 "decode": _count_calls(monkeypatch, MonoCut, "load_audio")}
        batches = list(islice(iter(loader), 6))
        assert len(batches) == 6
        counters[workers] = {name: count[0] for name, count in calls.items()}
        monkeypatch.undo()
    assert min(counters[0].values()) > 0, counters  # the counters see the work when it happens here
    assert counters[2] == {"prepare": 0, "header": 0, "decode": 0}


def _ids_and_audio(batches):
    return [(b.sample_ids, b.input_ids.tolist(), b.audios) for b in batches]


@pytest.mark.parametrize("packing, bucketing", [(False, False), (True, False), (False, True)])
def test_any_worker_count_gives_the_same_batches_fresh_and_resumed(tiny_target, audio_estimator, demo_data, packing,
                                                                   bucketing):
    """Bucketing included: lhotse seeds its bucket choice with the worker id inside a worker, unless told not to."""
    def batches(workers, resumed_after=0, n=5):
        module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], workers=workers, packing=packing,
                         use_bucketing=bucketing, rank=0, world_size=2)
        if resumed_after:
            _resumed_after(module, resumed_after)
        return _ids_and_audio(islice(iter(module.train_dataloader()), n))

    straight = batches(0, n=8)
    for workers in (1, 3):
        got = batches(workers, n=8)
        assert [g[:2] for g in got] == [s[:2] for s in straight], workers
        assert all(torch.equal(g[2], s[2]) for g, s in zip(got, straight))
    assert [b[:2] for b in batches(3, resumed_after=3)] == [s[:2] for s in straight[3:8]]


@pytest.mark.parametrize("bucketing", [False, True])
def test_validation_dealing_across_ranks_is_the_same_with_workers(tiny_target, audio_estimator, demo_data, tmp_path,
                                                                  bucketing):
    val = tmp_path / "val.jsonl.gz"
    CutSet.from_file(demo_data[0]).subset(first=20).to_file(val)

    def ids(rank, workers):
        module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], [_cuts(val)], workers=workers,
                         rank=rank, world_size=2, batch_tokens=None, max_tokens=None, batch_size=3,
                         use_bucketing=bucketing)
        (loader,) = module.val_dataloader()
        first, again = [b.sample_ids for b in loader], [b.sample_ids for b in loader]  # persistent workers
        assert first == again
        return first

    for rank in (0, 1):
        assert ids(rank, 3) == ids(rank, 0)
    flat = [sum(ids(r, 2), []) for r in (0, 1)]
    assert len(ids(0, 2)) == len(ids(1, 2)) and set(flat[0]).isdisjoint(flat[1])


def test_skips_met_in_workers_are_counted_once(tiny_target, audio_estimator, demo_data, tmp_path):
    cuts = list(CutSet.from_file(demo_data[0]))
    for cut in cuts[::3]:
        cut.supervisions = []
    bad = len(cuts[::3])
    CutSet(cuts).to_file(tmp_path / "some_bad.jsonl.gz")
    bad_input = [_cuts(tmp_path / "some_bad.jsonl.gz")]
    totals = []
    for rank, world_size in ((0, 1), (0, 2), (1, 2)):
        module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])], bad_input, workers=3, rank=rank,
                         world_size=world_size)
        (loader,) = module.val_dataloader()
        for _ in range(2):  # a second validation run meets the same skips: still counted once
            assert list(loader)
        totals.append(module.skip_counts().get("no_supervision", 0))
    assert bad >= 5 and totals[0] == bad and totals[1] + totals[2] == bad and 0 < totals[1] < bad


def test_a_bad_record_met_in_a_worker_stops_the_run_with_its_one_line(tiny_target, audio_estimator, demo_data,
                                                                     tmp_path):
    chats = tmp_path / "roles.jsonl"
    chats.write_text('{"id": "c", "conversations": [{"from": "Robot", "type": "text", "value": "hi"}]}\n')
    module = _module(tiny_target, audio_estimator, [_cuts(demo_data[0])],
                     [InputConfig(type="multimodal_conversation", manifest_filepath=str(chats))], workers=2)
    (loader,) = module.val_dataloader()
    with pytest.raises(DataError) as err:
        list(loader)
    assert str(err.value) == f"{chats}:1: turn 0: unknown role from='Robot' (expected User, Assistant or System)"
    assert "\n" not in str(err.value) and "worker process" in err.value.__notes__[0]


EXITS_AFTER_A_WORKER_RAISED = """
from dflash_train.config.schema import DatasetConfig
from dflash_train.data.conversation import DataError
from dflash_train.data.examples import SkipCounter
from dflash_train.data.loader import speech_loader


def collate(examples):
    if examples == ["bad"]:
        raise DataError("records.jsonl:2: a planted bad record")
    return examples


for batch in speech_loader([["good"], ["bad"], ["good"]], collate, SkipCounter(), DatasetConfig(num_workers=2)):
    pass
"""


def test_a_process_whose_worker_raised_exits_with_the_error(tmp_path):
    """The workers ignore SIGTERM (preemption is the trainer's), which is how ``multiprocessing`` stops them at
    exit: without the loader's own exit hook the failed process would wait for its workers forever."""
    script = tmp_path / "fails.py"
    script.write_text(EXITS_AFTER_A_WORKER_RAISED)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "dflash_train.data.conversation.DataError: records.jsonl:2: a planted bad record"
