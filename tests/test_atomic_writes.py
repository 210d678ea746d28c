"""Exports and checkpoints are renamed into place whole: a failure mid-write leaves the previous version."""

import os

import pytest
import torch
from conftest import UTTERANCES, chatml_speech_batch, same_tensors
from listdata import ListDataModule
from safetensors.torch import load_file
from test_module import _recipe

from dflash_train import atomic
from dflash_train.atomic import AtomicCheckpointIO, atomic_directory
from dflash_train.training.recipe import train

TEXTS = list(UTTERANCES.values())


def test_atomic_directory_replaces_on_success_and_keeps_the_old_one_on_failure(tmp_path):
    out = tmp_path / "export"
    with atomic_directory(out) as staging:
        assert staging.parent == tmp_path and staging != out
        (staging / "a.txt").write_text("first")
    assert (out / "a.txt").read_text() == "first"

    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(out) as staging:
            (staging / "a.txt").write_text("half")
            raise RuntimeError("disk full")
    assert (out / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging left behind

    with atomic_directory(out) as staging:
        (staging / "b.txt").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_checkpoint_io_writes_beside_the_checkpoint_and_keeps_the_old_one_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}

    seen = []

    def failing_save(obj, handle):
        handle.write(b"partial bytes")
        handle.flush()
        seen.extend(os.listdir(path.parent))
        raise OSError("killed")

    monkeypatch.setattr(atomic.torch, "save", failing_save)
    with pytest.raises(OSError, match="killed"):
        io.save_checkpoint({"step": 2}, path)
    assert any(name.startswith(".last.ckpt.tmp-") for name in seen), seen  # same directory, same filesystem
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_a_failed_export_leaves_the_previous_export_whole(tiny_salm_dir, tiny_target, speech_batch, tmp_path,
                                                          monkeypatch):
    from dflash_train.draft import export
    from dflash_train.draft.export import DraftExportError

    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)

    def factory(run, target):
        return ListDataModule([batch], [batch])

    first = train(_recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=1", "exp_manager.resume_if_exists=false"), factory)
    before = load_file(str(first.export_dir / "model.safetensors"))

    def corrupt(out_dir, state):
        raise DraftExportError(f"{out_dir}: reloaded weights differ")

    monkeypatch.setattr(export, "verify_export", corrupt)  # the DFlash variant's export step calls it
    with pytest.raises(DraftExportError):
        train(_recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=2", "exp_manager.resume_if_exists=false",
                      "dflash.lr=0.5"), factory)
    after = load_file(str(first.export_dir / "model.safetensors"))
    assert same_tensors(before, after)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


def test_the_trainer_saves_checkpoints_through_the_atomic_writer(tiny_salm_dir, tiny_target, speech_batch, tmp_path,
                                                                 monkeypatch):
    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    saved = []
    original = atomic.atomic_torch_save

    def spy(obj, path):
        saved.append(os.fspath(path))
        original(obj, path)

    monkeypatch.setattr(atomic, "atomic_torch_save", spy)
    train(_recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=2", "exp_manager.checkpoint_every_n_steps=1"),
          lambda run, target: ListDataModule([batch], [batch]))
    assert str(tmp_path / "checkpoints" / "last.ckpt") in saved
