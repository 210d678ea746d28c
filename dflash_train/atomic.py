"""Writes that never leave a half-written file or directory where a reader expects a whole one.

Everything is written beside its destination (same directory, so the same filesystem) and
renamed into place: a crash, a kill or a full disk leaves the previous version, or nothing,
plus at most a hidden temporary entry, never a truncated checkpoint or export.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(destination: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``destination``; on success it replaces ``destination``.

    On an exception the temporary directory is removed and ``destination`` is untouched.
    An existing ``destination`` is moved aside first and deleted only after the new one is
    in place, so some complete version exists at every moment.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        previous: Optional[Path] = None
        if destination.exists():
            previous = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
            os.replace(destination, previous / destination.name)
        os.replace(staging, destination)
        _fsync_directory(destination.parent)
        if previous is not None:
            shutil.rmtree(previous)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(handle)`` into a temporary file in ``path``'s directory, flushed and renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
        _fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through :func:`atomic_write`."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def atomic_write_text(path: str | Path, text: str) -> None:
    """UTF-8 ``text`` through :func:`atomic_write`."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose temporary file lives beside the checkpoint.

    Lightning's default writes through an fsspec transaction whose temporary file is in the
    system temp directory, then moves it: across filesystems that move is a copy, and a
    job killed during it leaves a truncated ``last.ckpt`` on the shared filesystem.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        atomic_torch_save(checkpoint, path)
