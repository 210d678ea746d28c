"""Facts about the launch that every process of it must agree on, available before any process group.

Hydra resolves ``${now:...}`` separately in every process, so ranks started a second apart
would write to different run directories. :func:`launch_stamp` gives one timestamp per
launch instead: under torchrun the first process to ask stores its clock reading in the
launcher's own key-value store (the one ``torch.distributed`` rendezvous uses) and every
process reads that value; under SLURM without torchrun the job id and restart count name
the launch; a single process uses its own clock.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Optional

STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
STORE_TIMEOUT_SECONDS = 120


def _torchrun_stamp(local: str) -> str:
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_SECONDS),
    )
    key = f"dflash_train/launch_stamp/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return store.compare_set(key, "", local).decode()


def launch_stamp() -> str:
    """``YYYY-MM-DD_HH-MM-SS`` of this launch, identical on every rank (see the module docstring)."""
    local = time.strftime(STAMP_FORMAT)
    processes = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or "1"
    if int(processes) <= 1:
        return local
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        return _torchrun_stamp(local)
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    raise RuntimeError(
        "cannot agree on a run directory across ranks: WORLD_SIZE > 1 without torchrun or SLURM; "
        "set hydra.run.dir to a fixed path"
    )


def run_directory_of(explicit_log_dir: Optional[str], exp_dir: str, name: str, version: Optional[str] = None) -> Path:
    """A run's directory: ``exp_manager.explicit_log_dir``, else ``exp_dir/name[/version]``."""
    if explicit_log_dir:
        return Path(explicit_log_dir)
    base = Path(exp_dir) / name
    return base / version if version else base


def hydra_log_root(explicit_log_dir: Optional[str], exp_dir: str, name: str, version: Optional[str] = None) -> str:
    """Where Hydra writes a launch's per-rank logs (``${dflash_run_dir:...}`` in ``hydra.run.dir``): the run
    directory. One that cannot be created (a file in its path, no permission) is left to the launch's own
    one-line error; Hydra, which creates its directory first, writes that launch's logs to the system's
    temporary directory instead of failing with a traceback."""
    import tempfile

    from dflash_train.errors import InputFileError
    from dflash_train.files import check_writable_directory

    run_dir = run_directory_of(explicit_log_dir, exp_dir, name, version)
    try:
        check_writable_directory(run_dir, "the run directory")
    except InputFileError:
        return str(Path(tempfile.gettempdir()) / "dflash_train-unwritable-run-dir")
    return str(run_dir)
