"""Errors the framework raises for user-fixable problems (bad config, bad target, bad data)."""

LOADER_WORKER_PREFIX = "Caught "  # how torch's DataLoader starts an error it re-raises from a worker


def loader_worker_message(message: str) -> tuple[str, str]:
    """``(one line, worker traceback)`` of an error message; the traceback is empty unless ``message`` is
    the text torch's ``DataLoader`` builds when it re-raises a worker's error in the training process
    ("Caught X in DataLoader worker process N. Original Traceback ... X: <the original message>")."""
    if not (message.startswith(LOADER_WORKER_PREFIX) and "\nOriginal Traceback" in message):
        return message, ""
    last = message.rstrip().rsplit("\n", 1)[-1]
    original = last.split(": ", 1)[1] if ": " in last else last
    return original, message


class OneLineError(Exception):
    """An error whose message stays the one line it was raised with, also when a loader worker raised it.

    torch re-raises a worker's exception in the training process as ``type(err)(text)`` where the
    text is the worker's whole traceback; this keeps the original line as the message and attaches
    the worker's traceback as a note (shown with ``--debug`` / ``HYDRA_FULL_ERROR=1``).
    """

    def __init__(self, message: str = ""):
        line, worker_traceback = loader_worker_message(str(message))
        super().__init__(line)
        if worker_traceback:
            self.add_note(worker_traceback)


class ConfigError(OneLineError, ValueError):
    """A configuration value is wrong; the message names the key and the fix in one line."""


class MissingDependencyError(ImportError):
    """A package the requested work needs is not installed; the message gives the install line."""


class InputFileError(OneLineError, ValueError):
    """An input file or directory is missing, empty, truncated or of the wrong kind; the message names it and the fix."""


class NonFiniteTrainingError(RuntimeError):
    """Training produced NaN or infinite gradients too many steps in a row; the message names the limit and the fix."""
