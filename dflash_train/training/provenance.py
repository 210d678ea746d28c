"""What made a run and its export: written with the run (``run_info.json``) and into the export.

Rank 0 writes ``<run dir>/run_info.json`` and ``<run dir>/resolved_config.yaml`` when training
starts (after a resume has restored its step), and the export's ``config.json`` carries a
``training_info`` block (vLLM ignores unknown config keys) with the global step it represents and
the same provenance, so an export alone says what produced it (docs/training.md, Provenance).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import Callback

from dflash_train.atomic import atomic_write_text
from dflash_train.config.schema import RunConfig
from dflash_train.constants import CONFIG_FILE, WEIGHTS_FILE
from dflash_train.data.inputs import input_path
from dflash_train.files import sha256_file

PACKAGES = ("dflash_train", "nemo_toolkit", "nemo_automodel", "torch", "lightning", "lhotse", "transformers")
RUN_INFO_FILE = "run_info.json"
RESOLVED_CONFIG_FILE = "resolved_config.yaml"


def package_versions() -> dict[str, Optional[str]]:
    """Installed versions of this project and the libraries that decide its numbers (``None``: not installed)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_revision() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``"not a git checkout"``."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return "not a git checkout"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return commit.stdout.strip() + ("+dirty" if dirty else "")


@lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def weights_sha256(path: Path) -> str:
    """SHA-256 of a weights file, computed once per process for an unchanged file (run_info and the
    checkpoint identity both need the target's)."""
    stat = path.stat()
    return _sha256_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def target_weights_file(run: RunConfig) -> Optional[Path]:
    """``model.pretrained_name``'s weights file (``None`` for a target built from ``model.salm``)."""
    name = run.model.pretrained_name
    weights = Path(name).expanduser() / WEIGHTS_FILE if name else None
    return weights if weights is not None and weights.is_file() else None


def _fingerprint(directory: Optional[str]) -> Optional[dict]:
    if directory is None or not Path(directory).is_dir():
        return None
    path = Path(directory)
    config = path / CONFIG_FILE
    return {
        "path": str(path.resolve()),
        "config_sha256": sha256_file(config) if config.is_file() else None,
        "weights_sha256": weights_sha256(path / WEIGHTS_FILE) if (path / WEIGHTS_FILE).is_file() else None,
    }


def run_info(run: RunConfig, world_size: int, start_step: int) -> dict:
    """The provenance record of a run (what ``run_info.json`` holds)."""
    data = run.data
    blend = {
        split: [{"path": input_path(i), "type": i.type, "weight": i.weight, "name": i.name} for i in ds.input_cfg]
        for split, ds in (("train", data.train_ds), ("validation", data.validation_ds)) if ds is not None
    }
    return {
        "dflash_train_revision": git_revision(),
        "versions": package_versions(),
        "target": _fingerprint(run.model.pretrained_name) or {"built_from": "model.salm"},
        "target_init_from_checkpoint": run.model.init_from_checkpoint,
        "warm_start": _fingerprint(run.dflash.init_from_pretrained) or "fresh",
        "variant": run.dflash.variant,
        "data": blend,
        "seed": run.seed,
        "world_size": world_size,
        "start_step": start_step,
    }


class ProvenanceRecord(Callback):
    """Writes ``run_info.json`` + ``resolved_config.yaml`` at train start (rank 0) and keeps the record
    for the export (:attr:`info`)."""

    def __init__(self, run: RunConfig, run_dir: Path):
        self.run = run
        self.run_dir = Path(run_dir)
        self.info: Optional[dict] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from omegaconf import OmegaConf

        if not trainer.is_global_zero:  # only rank 0 writes it and the export (no other rank reads the weights)
            return
        self.info = run_info(self.run, trainer.world_size, trainer.global_step)
        resolved = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.asdict(self.run)))
        atomic_write_text(self.run_dir / RUN_INFO_FILE, json.dumps(self.info, indent=2))
        atomic_write_text(self.run_dir / RESOLVED_CONFIG_FILE, resolved)

    def training_info(self, global_step: int) -> dict:
        """The export's ``training_info`` block: the step it represents and the run's provenance."""
        return {"global_step": int(global_step), "run_dir": str(self.run_dir.resolve()), **(self.info or {})}
