"""What every console command does with an error it can explain: one line naming the file or key
and the fix, a non-zero exit, no traceback (``--debug``, or ``HYDRA_FULL_ERROR=1`` for
``dflash-train``, shows it)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input or configuration, not a bug: each carries a one-line message."""
    from dflash_train.data.conversation import DataError
    from dflash_train.draft.export import DraftExportError
    from dflash_train.errors import ConfigError, InputFileError, MissingDependencyError, NonFiniteTrainingError
    from dflash_train.evaluate.arguments import UsageError
    from dflash_train.evaluate.report import ReportMismatch
    from dflash_train.target import PlaceholderMismatchError, TargetLoadError
    from dflash_train.target.vllm_export import TargetExportError

    return (
        ConfigError, DataError, DraftExportError, InputFileError, MissingDependencyError, NonFiniteTrainingError,
        PlaceholderMismatchError,
        ReportMismatch, TargetExportError, TargetLoadError, UsageError,
    )


def describe(err: BaseException) -> str:
    """The error as one line; an ``OSError`` from reading or writing names its file."""
    if isinstance(err, OSError) and not isinstance(err, tuple(user_errors())):
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror or err}; check the path and its permissions"
    return " ".join(str(err).split("\n"))


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")


def run_command(prog: str, body: Callable[[], int], debug: bool, exit_code: int = 2) -> int:
    """``body()``'s exit code; a user error or an ``OSError`` prints ``<prog>: error: <one line>`` and
    returns ``exit_code`` (with ``debug`` it propagates instead)."""
    try:
        return body()
    except (*user_errors(), OSError) as err:
        if debug:
            raise
        print(f"{prog}: error: {describe(err)}", file=sys.stderr)
        return exit_code
