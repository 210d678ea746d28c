"""The MTP route: serve a SpeechLM whose LLM carries multi-token-prediction heads with ``method: "mtp"``.

A NeMo SpeechLM MTP checkpoint is one directory: the SALM weights plus the MTP weights under
``llm.mtp.layers.<j>.*`` and an ``mtp`` block in ``config.json`` (``enabled``,
``num_nextn_predict_layers``, ``use_repeated_layer``, ``hybrid_override_pattern``). vLLM builds
an MTP draft from the *target's* path and hands its config to
``SpeculativeConfig.hf_config_override``; the pinned NeMo 3.0.0 plugin knows no SpeechLM MTP, so
this module extends that hook (:func:`install`):

- a config of model type ``nemo_speechlm`` with an enabled ``mtp`` block becomes the draft config
  of :data:`MTP_ARCHITECTURE` (vLLM's ``NemotronHMTP`` sublayers, see
  :mod:`dflash_train.vllm_plugin.salm_mtp`), with ``n_predict = 1``: vLLM's proposer runs one MTP
  step on its own output for every draft position, so one *repeated* layer serves any K;
- every other config goes to vLLM's own hook unchanged.

The hook is a module-level function (the draft ``ModelConfig`` that holds it is pickled into
vLLM's engine processes); vLLM's own hook is found again in a process that unpickled it before
the plugin ran. Everything here but :func:`install` and :func:`native_hf_config_override` works
without vLLM, so the checkpoint rules are testable in the main environment.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional

from dflash_train.constants import MTP_WEIGHT_PREFIX
from dflash_train.draft.mtp import SUBLAYER_TYPES, MTPBlock, MTPConfigError, stored_step_module

MTP_MODEL_TYPE = "nemo_speechlm_mtp"
"""Model type of the draft config; added to vLLM's ``MTPModelTypes`` so method "mtp" accepts it."""

MTP_ARCHITECTURE = "DFlashSpeechLMMTPModel"
"""The draft architecture registered with vLLM (our name: NeMo's later plugin keeps its own)."""

MTP_MODEL_CLASS = "dflash_train.vllm_plugin.salm_mtp:DFlashSpeechLMMTP"

SALM_MODEL_TYPE = "nemo_speechlm"
HOOK_MARKER = "_dflash_speechlm_mtp_hook"


class SpeechLMMTP(MTPBlock):
    """The checked ``mtp`` block (:class:`~dflash_train.draft.mtp.MTPBlock`) and the draft config vLLM builds from it."""

    def draft_text_config(self, text_config: Any) -> Any:
        """The language config vLLM's ``NemotronHMTP`` builds the draft from (one physical step).

        A Nemotron-H backbone keeps its config, with one MTP step of this pattern. Any other
        backbone (e.g. Qwen3) gets a Nemotron-H config of its own width, heads and norm epsilon:
        the MTP step is a Nemotron-H step whatever the backbone.
        """
        from transformers import NemotronHConfig

        sublayers = [SUBLAYER_TYPES[c] for c in self.pattern]
        if getattr(text_config, "model_type", None) == "nemotron_h":
            draft = copy.deepcopy(text_config)
            draft.mtp_layers_block_type = sublayers
            draft.num_nextn_predict_layers = 1
            return draft
        missing = [
            k for k in ("hidden_size", "num_attention_heads", "vocab_size") if getattr(text_config, k, None) is None
        ]
        if missing:
            raise MTPConfigError(f"the LLM backbone config lacks {missing}: it cannot carry Nemotron-H MTP sublayers")
        heads = text_config.num_attention_heads
        draft = NemotronHConfig(
            vocab_size=text_config.vocab_size,
            hidden_size=text_config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
            attention_bias=bool(getattr(text_config, "attention_bias", False)),
            layer_norm_epsilon=getattr(text_config, "rms_norm_eps", None) or 1e-5,
            max_position_embeddings=getattr(text_config, "max_position_embeddings", 4096),
            layers_block_type=["full_attention"] * int(text_config.num_hidden_layers),
            mtp_layers_block_type=sublayers,
            num_nextn_predict_layers=1,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        )
        draft.architectures = list(getattr(text_config, "architectures", None) or [])
        return draft


def speechlm_mtp_hf_config_override(hf_config: Any) -> Any:
    """vLLM's draft-config hook, extended: a SpeechLM with MTP heads becomes our MTP draft config.

    A SpeechLM config without an enabled ``mtp`` block is an error here (vLLM only builds a
    draft from a SpeechLM checkpoint for method "mtp"); every other config is vLLM's business.
    """
    if getattr(hf_config, "model_type", None) != SALM_MODEL_TYPE:
        return native_hf_config_override()(hf_config)
    mtp = SpeechLMMTP.from_block(getattr(hf_config, "mtp", None))
    if mtp is None:
        raise MTPConfigError(
            "speculative method 'mtp' needs MTP heads in the target, but its config.json has no mtp block with "
            "enabled: true; serve it with a DFlash draft instead, or train MTP heads and export them into the target"
        )
    hf_config.text_config = mtp.draft_text_config(hf_config.text_config)
    hf_config.update(
        {
            "model_type": MTP_MODEL_TYPE,
            "architectures": [MTP_ARCHITECTURE],
            "n_predict": 1,
            "num_nextn_predict_layers": 1,
        }
    )
    return hf_config


setattr(speechlm_mtp_hf_config_override, HOOK_MARKER, True)

_native_hook: Optional[Any] = None


def native_hf_config_override() -> Any:
    """vLLM's own ``hf_config_override`` (the first hook found before ours, kept for this process).

    A process that unpickled our hook before the plugin ran (a spawned engine) finds the class
    attribute still vLLM's. If the class already holds our hook but its predecessor was never
    recorded, delegating would call ourselves: that fails with one line instead of recursing.
    """
    global _native_hook
    if _native_hook is None:
        from vllm.config.speculative import SpeculativeConfig

        hook = SpeculativeConfig.hf_config_override
        if getattr(hook, HOOK_MARKER, False):
            raise RuntimeError(
                "dflash_train's MTP hook is installed on SpeculativeConfig.hf_config_override but vLLM's own hook "
                "was not kept; install it only through dflash_train.vllm_plugin.register()"
            )
        _native_hook = hook
    return _native_hook


def install(speculative_module: Any) -> bool:
    """Put our hook on ``speculative_module.SpeculativeConfig`` and accept our draft model type as MTP.

    Idempotent; returns whether anything changed. The hook found first is kept as the one to
    delegate to, so a re-install never wraps a wrapper of itself.
    """
    global _native_hook
    from typing import Literal, get_args

    changed = False
    mtp_types = get_args(speculative_module.MTPModelTypes)
    if MTP_MODEL_TYPE not in mtp_types:
        speculative_module.MTPModelTypes = Literal[mtp_types + (MTP_MODEL_TYPE,)]
        changed = True
    config_class = speculative_module.SpeculativeConfig
    current = config_class.hf_config_override
    if not getattr(current, HOOK_MARKER, False):
        if _native_hook is None:
            _native_hook = current
        config_class.hf_config_override = staticmethod(speechlm_mtp_hf_config_override)
        changed = True
    return changed


def _pad_rows(tensor, rows: int):
    """Zero rows appended up to ``rows`` (the SpeechLM's padded vocabulary), as the target side pads."""
    import torch

    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def mtp_checkpoint_weights(
    weights: Iterable[tuple[str, Any]], vocab_size: int, modules_per_step: int
) -> Iterator[tuple[str, Any]]:
    """A SpeechLM checkpoint's tensors under the names ``NemotronHMTP.load_weights`` reads.

    ``llm.mtp.layers.<j>.*`` become ``mtp.layers.<j>.*`` (``j`` below ``modules_per_step``, the
    pattern length: one stored step); the embedding (``llm.model.embed_tokens`` of a Nemotron-H
    SpeechLM, ``embed_tokens`` of a SALM) becomes ``backbone.embeddings.weight``, zero-padded to
    the served vocabulary (vLLM then shares the target's table); packed MoE experts are split
    per expert. ``_extra_state`` and every other tensor (perception, backbone, LM head, which
    vLLM shares from the target) are left out.
    """
    for name, tensor in weights:
        if "._extra_state" in name:
            continue
        if name in ("embed_tokens.weight", "llm.model.embed_tokens.weight"):
            yield "backbone.embeddings.weight", _pad_rows(tensor, vocab_size)
            continue
        if not name.startswith(MTP_WEIGHT_PREFIX):
            continue
        j, rest = stored_step_module(name, modules_per_step)
        name = f"mtp.layers.{j}.{rest}"
        if name.endswith((".experts.down_projs", ".experts.gate_and_up_projs")):
            stem, packed = name.rsplit(".experts.", 1)
            projection = "down_proj" if packed == "down_projs" else "up_proj"
            for expert in range(tensor.shape[0]):
                yield f"{stem}.experts.{expert}.{projection}.weight", tensor[expert].t()
            continue
        yield name, tensor
