"""NeMo's ``model.*`` keys of a SpeechLM recipe (``salm.yaml``, ``salm_automodel.yaml``) in this project's terms.

A run config may inherit NeMo's SpeechLM recipe, whose ``model`` section describes how the SpeechLM
is built and trained. Each key keeps NeMo's meaning here:

* ``prompt_format`` is ``data.prompt_format`` (NeMo spells ``nemotron-nano-v3`` with hyphens);
* ``pretrained_llm``, ``pretrained_asr``, ``perception``, ``pretrained_weights`` build the SpeechLM:
  with ``model.pretrained_name`` the checkpoint's own ``config.json`` defines it (as NeMo's
  ``from_pretrained`` does), without one they are the ``model.salm`` the target is built from;
* ``use_nemo_automodel`` / ``automodel_backend`` say the LLM was built by nemo_automodel
  (``SALMAutomodel``): its checkpoint names are read on any device, while building it from
  scratch needs nemo_automodel's GPU path and is refused;
* ``mtp`` describes the SpeechLM's own MTP heads, stored beside the LLM and not part of the target;
* the keys of :data:`SPEECHLM_TRAINING_KEYS` steer training the SpeechLM itself; the target is
  frozen here, so they change nothing and one warning lists them.
"""

from __future__ import annotations

import logging

from dflash_train.config.schema import DEFAULT_PROMPT_FORMAT, RunConfig
from dflash_train.errors import ConfigError

log = logging.getLogger(__name__)

SPEECHLM_BUILD_KEYS = ("pretrained_llm", "pretrained_asr", "perception", "pretrained_weights")
SPEECHLM_TRAINING_KEYS = (
    "freeze_params",
    "prevent_freeze_params",
    "aux_loss_coeff",
    "train_gate",
    "packed_encoder_sequences",
    "lora",
    "optimizer",
    "lr_scheduler",
)


def resolve_nemo_model_keys(run: RunConfig) -> None:
    """Give NeMo's ``model.*`` keys their meaning in this project's keys, in place (module docstring)."""
    model = run.model
    _resolve_prompt_format(run)
    build = {key: getattr(model, key) for key in SPEECHLM_BUILD_KEYS if getattr(model, key) is not None}
    if model.pretrained_name is None and model.salm is None and build:
        if model.use_nemo_automodel:
            raise ConfigError(
                "model.use_nemo_automodel=true without model.pretrained_name builds SALMAutomodel, which needs "
                "nemo_automodel's GPU path; point model.pretrained_name at the trained SpeechLM's directory"
            )
        if model.pretrained_llm is None:
            raise ConfigError("model.pretrained_asr/perception build a SALM only with model.pretrained_llm; set it")
        model.salm = {**build, "audio_locator_tag": model.audio_locator_tag, "prompt_format": run.data.prompt_format}
    elif build and model.pretrained_name is not None:
        log.info(
            "model.%s: the checkpoint's config.json defines the SpeechLM (model.pretrained_name=%s), as NeMo's "
            "from_pretrained does",
            "/".join(build),
            model.pretrained_name,
        )
    inert = [key for key in SPEECHLM_TRAINING_KEYS if getattr(model, key) is not None]
    if inert:
        log.warning(
            "model.%s steer training the SpeechLM itself; the target is frozen here, so they change nothing",
            "/".join(inert),
        )


def _resolve_prompt_format(run: RunConfig) -> None:
    named = run.model.prompt_format.replace("-", "_") if run.model.prompt_format is not None else None
    data = run.data.prompt_format
    if named is not None and data is not None and named != data:
        raise ConfigError(
            f"model.prompt_format='{run.model.prompt_format}' and data.prompt_format='{data}' disagree; they name "
            "one setting (the chat format), set one of them"
        )
    run.data.prompt_format = data or named or DEFAULT_PROMPT_FORMAT
