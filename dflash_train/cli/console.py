"""What a run prints: each line once, INFO lines from rank 0 only, and no third-party notice the user need not act on.

Every command line tool calls :func:`configure_console` first. Known-harmless notices are silenced at
their source, each by its logger (or warning's module) and message, with the reason next to it in
:data:`KNOWN_NOTICES`; nothing is filtered by a blanket rule. On ranks other than 0 the console shows
warnings and errors only (a rank's own skips are warnings); each rank's log file under the run's
Hydra directory keeps all its lines. ``DFLASH_VERBOSE=1`` in the environment brings everything back:
every notice, and every rank's INFO lines.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

from dflash_train.constants import VERBOSE_ENV

LOG_FORMAT = "[%(asctime)s %(name)s %(levelname)s] %(message)s"


@dataclass(frozen=True)
class KnownNotice:
    """A third-party notice that needs no action: where it comes from, how it starts, and why it is harmless.

    ``warning=True``: a Python warning raised in module ``source``; else a log record of logger ``source``.
    """

    source: str
    message: str  # a regular expression matched at the start of the message
    reason: str
    warning: bool = False

    def keeps(self, record: logging.LogRecord) -> bool:
        """As a logging filter: keep every record but this notice."""
        return re.match(self.message, record.getMessage()) is None


KNOWN_NOTICES = (
    KnownNotice(
        "lightning.pytorch.trainer.connectors.logger_connector.result", r"It is recommended to use `self\.log\(",
        "our validation metrics are all-reduced over ranks by the module before it logs them "
        "(training/metrics.py); Lightning's sync_dist would add one collective per value for nothing",
        warning=True,
    ),
    KnownNotice(
        "lightning.fabric.loggers.csv_logs", r"Experiment logs directory .* exists and is not empty",
        "a resumed launch: the recipe has already moved the previous launch's metrics.csv aside "
        "(training/history.py), so the CSV logger deletes nothing",
        warning=True,
    ),
    KnownNotice(
        "transformers.configuration_utils", r"You are using a model of type `nemo_speechlm`",
        "a NeMo SpeechLM checkpoint's config.json names NeMo's own model type, not a transformers one",
    ),
    KnownNotice(
        "transformers.modeling_utils", r"`torch_dtype` is deprecated",
        "NeMo's SALM builds its LLM with the argument's old name (nemo.collections.speechlm2.parts.pretrained)",
    ),
    KnownNotice(
        "nv_one_logger.api.config", r"OneLogger: Setting error_handling_strategy",
        "NeMo's training telemetry (OneLogger) is off in these runs",
    ),
    KnownNotice(
        "nv_one_logger.exporter.export_config_manager", r"Final configuration contains 0 exporter",
        "NeMo's training telemetry (OneLogger) is off in these runs",
    ),
    KnownNotice(
        "nv_one_logger.training_telemetry.api.training_telemetry_provider", r"No exporters were provided",
        "NeMo's training telemetry (OneLogger) is off in these runs",
    ),
    KnownNotice(
        "nemo_automodel._transformers.v4_patches.layer_types", r"\[v4_patches\.layer_types\] extended",
        "nemo_automodel registering its layer types with transformers when it is imported",
    ),
)


def console_level() -> str:
    """This process's console level: INFO on rank 0 (``RANK``, as torchrun sets it) or with ``DFLASH_VERBOSE=1``,
    WARNING elsewhere. ``dflash-train`` gives it to Hydra's console handler too (``hydra.job_logging``)."""
    return "INFO" if os.environ.get("RANK", "0") == "0" or os.environ.get(VERBOSE_ENV) == "1" else "WARNING"


def configure_console() -> None:
    """Log lines in one format through one handler (each printed once), known notices silenced."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setLevel(console_level())
    import lightning  # noqa: F401  (its import gives the 'lightning' logger a handler of its own: below)

    # Lightning's own console handler repeats every line its loggers also propagate to ours
    # ("Seed set to 42" and the model summary twice): one handler prints them.
    lightning_logger = logging.getLogger("lightning")
    for handler in list(lightning_logger.handlers):
        if type(handler) is logging.StreamHandler:
            lightning_logger.removeHandler(handler)
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for notice in KNOWN_NOTICES:
        if notice.warning:
            warnings.filterwarnings("ignore", message=notice.message, module=re.escape(notice.source))
        else:
            logging.getLogger(notice.source).addFilter(notice.keeps)
