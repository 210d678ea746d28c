"""vLLM plugin: serve a NeMo SALM target with a DFlash / DFlash2 draft exported by dflash_train.

``pip install`` of this project registers :func:`register` as the ``dflash_train`` entry point
of group ``vllm.general_plugins``; vLLM calls it in every process that builds an engine. It

- registers NeMo's SALM config (model type ``nemo_speechlm``) and our SALM target class under
  :data:`SALM_ARCHITECTURE`, the architecture ``dflash-export-target`` writes into a target's
  ``config.json`` (NeMo's own plugin keeps ``NeMoSpeechLMForConditionalGeneration``, so the
  result does not depend on which plugin vLLM runs first);
- aliases training-time draft class names to vLLM's ``DFlashDraftModel`` / ``DFlash2DraftModel``;
- opens the MTP route (:mod:`dflash_train.vllm_plugin.mtp`): registers the SpeechLM MTP draft
  :data:`~dflash_train.vllm_plugin.mtp.MTP_ARCHITECTURE` and extends vLLM's draft-config hook so
  ``{"method": "mtp"}`` on a SpeechLM checkpoint with MTP heads builds it;
- works around other packages' bugs on the versions we serve with (:mod:`dflash_train.vllm_plugin.compat`).

The rest of ``dflash_train`` never imports vLLM; this package imports it only inside
:func:`register` and in :mod:`dflash_train.vllm_plugin.salm` and :mod:`dflash_train.vllm_plugin.salm_mtp`,
which vLLM loads lazily.
"""

from __future__ import annotations

import logging

from dflash_train.constants import SALM_ARCHITECTURE

log = logging.getLogger(__name__)

SALM_MODEL_CLASS = "dflash_train.vllm_plugin.salm:DFlashSALMForConditionalGeneration"


def register() -> None:
    """Register the SALM target class and the draft aliases with vLLM; safe to call any number of times.

    Without NeMo installed only the draft aliases are registered (a text-only Qwen3 target with
    a DFlash draft still benefits); serving a SALM then fails in vLLM with NeMo's import error.
    """
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError as err:
        raise ImportError(f"dflash_train's vLLM plugin needs vLLM installed ({err})") from None
    from dflash_train.vllm_plugin.aliases import alias_draft_architectures

    added = alias_draft_architectures(ModelRegistry)
    if added:
        log.info("dflash_train: draft architecture aliases %s", added)
    try:
        from nemo.collections.speechlm2.vllm.salm import register as register_nemo_salm_config
    except ImportError as err:
        log.warning("dflash_train: NeMo's SALM vLLM support is not importable (%s); SALM targets unavailable", err)
        return
    import vllm.config.speculative as speculative

    from dflash_train.vllm_plugin import mtp
    from dflash_train.vllm_plugin.compat import per_layer_context_k_norm_on_cpu, shield_llvmlite_from_kernel_scan

    # NeMo's register() is idempotent: it maps model type nemo_speechlm to NeMo's config class.
    register_nemo_salm_config()
    ModelRegistry.register_model(SALM_ARCHITECTURE, SALM_MODEL_CLASS)
    ModelRegistry.register_model(mtp.MTP_ARCHITECTURE, mtp.MTP_MODEL_CLASS)
    mtp.install(speculative)
    shield_llvmlite_from_kernel_scan()
    if per_layer_context_k_norm_on_cpu():
        log.info("dflash_train: vLLM-CPU DFlash context K-norm made per layer (its rms_norm kernel uses row 0 only)")
