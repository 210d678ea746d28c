"""Reading the files users hand us, with one-line errors that name the file and the fix.

Every reader here checks before it trusts: a safetensors file must be complete (its header
covers the whole file: a truncated copy fails here, not halfway through a load), a JSON file
must parse to an object, a directory must be one. The error is :class:`InputFileError`.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.errors import ConfigError, InputFileError


def require_directory(path: str | Path, what: str) -> Path:
    """``path`` as an existing directory; ``what`` says what it should be (e.g. ``"a draft export"``)."""
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"{path} does not exist; it should be {what}")
    if not path.is_dir():
        raise InputFileError(f"{path} is a file, not a directory; it should be {what}")
    return path


def read_json_object(path: str | Path, fix: str) -> dict:
    """The JSON object in ``path``; ``fix`` is what the user should do if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{path} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputFileError(f"{path} is not a readable JSON file ({type(err).__name__}: {err}); {fix}") from None
    if not isinstance(data, dict):
        raise InputFileError(f"{path} holds JSON but not an object; {fix}")
    return data


def check_safetensors(path: str | Path, fix: str) -> Path:
    """``path`` as a complete safetensors file (header parsed, tensors covering the file exactly)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path} does not exist; {fix}")
    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as err:  # SafetensorError for a truncated or foreign file, OSError for an unreadable one
        raise InputFileError(f"{path} is not a complete safetensors file ({err}); {fix}") from None
    return path


def load_safetensors(path: str | Path, fix: str) -> dict:
    """Every tensor of a complete safetensors file (see :func:`check_safetensors`)."""
    from safetensors.torch import load_file

    return load_file(str(check_safetensors(path, fix)))


def _check_creatable(path: Path, what: str) -> None:
    import os

    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputFileError(f"cannot write {what} {path}: {ancestor} is a file, not a directory; choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputFileError(f"cannot write {what} {path}: {ancestor} is not writable; choose another path")


def check_writable_file(path: str | Path, what: str) -> Path:
    """``path`` can be written as a file (``what`` names it, e.g. ``"the report"``), checked before
    expensive work so an unwritable output fails in the first second, not at the end."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise InputFileError(f"cannot write {what} {path}: it is a directory; give a file path")
    _check_creatable(path, what)
    return path


def check_writable_directory(path: str | Path, what: str) -> Path:
    """``path`` can be created (or replaced) as a directory; an existing file there is never replaced."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise InputFileError(f"cannot write {what} {path}: a file of that name exists; choose another path")
    _check_creatable(path, what)
    return path


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks): the fingerprint runs, exports and reports record."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def require_same_shapes(ours: dict, theirs: dict, what: str) -> None:
    """Every tensor of ``ours`` has its shape in ``theirs`` (a warm start of the same keys); else one line naming
    the first that differ, ``what`` saying what ``theirs`` holds (e.g. "dflash.init_from_pretrained='P' holds
    MTP heads of another target's shape")."""
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(ours[k].shape)}" for k in ours if theirs[k].shape != ours[k].shape]
    if shapes:
        raise ConfigError(f"{what}: {shapes[:4]}")


def load_state_exactly(module, weights: dict, source: str | Path, part: str, assign: bool = False) -> None:
    """Load ``weights`` into ``module`` with no key missing or left over; else one line naming the first ones.

    For a model assembled from a user's checkpoint (``part`` names which tensors, e.g. ``llm.*``),
    where a partial load would run silently wrong. ``assign``: the tensors become the parameters
    (a module built on the meta device), instead of being copied into them.
    """
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{source}: the {part} weights do not match the config (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    module.load_state_dict(weights, strict=True, assign=assign)
