"""The plugin inside a real vLLM, without an engine: entry point, plugin order, idempotency,
aliases resolving to vLLM's classes, the SALM class's interfaces and its clear failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from vllm.model_executor.models.interfaces import supports_eagle3, supports_multimodal
from vllm.model_executor.models.registry import ModelRegistry

from dflash_train.variants import ARCHITECTURE_ALIASES
from dflash_train.vllm_plugin import SALM_ARCHITECTURE, register
from dflash_train.vllm_plugin.backbone import AuxHiddenStatesUnsupported

# Runs the two plugins' register() in a given order (or vLLM's own loader) in a fresh process
# and prints what the registries then hold for the names the plugins touch.
PROBE = r"""
import json, sys
from importlib.metadata import entry_points
order = sys.argv[1:]
if order == ["vllm-loader"]:
    from vllm.plugins import load_general_plugins
    load_general_plugins()
else:
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    for name in order:
        plugins[name].load()()
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.config import _CONFIG_REGISTRY
names = [%r, "NeMoSpeechLMForConditionalGeneration", "DFlashDraftModel", "DFlash2DraftModel", *%r]
entries = {n: [ModelRegistry.models[n].module_name, ModelRegistry.models[n].class_name]
           for n in names if n in ModelRegistry.models}
config = _CONFIG_REGISTRY["nemo_speechlm"] if "nemo_speechlm" in _CONFIG_REGISTRY else None
print(json.dumps({"entries": entries, "config": config and f"{config.__module__}.{config.__name__}"}))
""" % (SALM_ARCHITECTURE, sorted(ARCHITECTURE_ALIASES))


def probe(*order: str, plugins: str | None = None) -> dict:
    env = {**os.environ, **({"VLLM_PLUGINS": plugins} if plugins is not None else {})}
    result = subprocess.run([sys.executable, "-c", PROBE, *order], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["dflash_train"] == "dflash_train.vllm_plugin:register"


def test_result_is_independent_of_plugin_order():
    ours_first = probe("dflash_train", "nemo_speechlm")
    nemo_first = probe("nemo_speechlm", "dflash_train")
    ours_only = probe("vllm-loader", plugins="dflash_train")
    assert ours_first == nemo_first
    assert ours_first["config"] == "nemo.collections.speechlm2.vllm.salm.config.NeMoSpeechLMConfig"
    assert ours_first["entries"][SALM_ARCHITECTURE] == [
        "dflash_train.vllm_plugin.salm",
        "DFlashSALMForConditionalGeneration",
    ]
    # with NeMo's plugin disabled, ours still registers everything a SALM target needs
    assert ours_only["config"] == ours_first["config"]
    assert ours_only["entries"][SALM_ARCHITECTURE] == ours_first["entries"][SALM_ARCHITECTURE]
    for alias, serving_name in ARCHITECTURE_ALIASES.items():
        assert ours_first["entries"][alias] == ours_first["entries"][serving_name]


def test_register_is_idempotent():
    register()
    snapshot = dict(ModelRegistry.models)
    register()
    assert dict(ModelRegistry.models) == snapshot


def test_training_time_names_resolve_to_vllms_draft_classes():
    register()
    for alias, serving_name in ARCHITECTURE_ALIASES.items():
        assert ModelRegistry._try_load_model_cls(alias) is ModelRegistry._try_load_model_cls(serving_name)


def test_salm_class_is_multimodal_and_eagle3_capable():
    register()
    cls = ModelRegistry._try_load_model_cls(SALM_ARCHITECTURE)
    assert cls.__name__ == "DFlashSALMForConditionalGeneration"
    assert supports_multimodal(cls) and supports_eagle3(cls)


def test_backbone_without_aux_hidden_states_fails_naming_it():
    from dflash_train.vllm_plugin.salm import DFlashSALMForConditionalGeneration

    model = DFlashSALMForConditionalGeneration.__new__(DFlashSALMForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.language_model = torch.nn.Linear(2, 2)  # a backbone class without the EAGLE-3 methods
    with pytest.raises(AuxHiddenStatesUnsupported, match="backbone Linear does not implement"):
        model.set_aux_hidden_state_layers((2, 4))
    with pytest.raises(AuxHiddenStatesUnsupported, match="backbone Linear"):
        model.get_eagle3_default_aux_hidden_state_layers()


def test_processor_adaptation_is_chosen_by_vllm_version():
    from nemo.collections.speechlm2.vllm.salm.audio import NeMoSpeechLMMultiModalProcessor

    from dflash_train.vllm_plugin.salm import TokenIdAudioProcessor, processor_for_vllm

    assert processor_for_vllm("0.32.0") is TokenIdAudioProcessor
    assert processor_for_vllm("0.33.1+cpu") is TokenIdAudioProcessor
    assert processor_for_vllm("0.31.0") is NeMoSpeechLMMultiModalProcessor


def test_dflash_context_keys_get_each_draft_layers_own_k_norm():
    """vLLM-CPU's rms_norm kernel uses row 0 of a [layers, head_dim] weight; after register() the
    DFlash draft's grouped context K-norm must still apply layer i's weight to layer i."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    register()
    torch.manual_seed(0)
    keys = torch.randn(3, 5, 2, 32)  # [layers, context, kv heads, head_dim]
    weights = torch.randn(3, 32)
    owner = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)
    normed = DFlashQwen3Model._normalize_context_k(owner, keys)
    expected = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6) * weights[:, None, None, :]
    torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)


# register() in a fresh process where NeMo cannot be imported: the draft aliases must still be
# registered, the SALM architecture must not be, and the log must say why.
WITHOUT_NEMO = r"""
import json, logging, sys
sys.modules["nemo"] = None  # `import nemo...` now raises ImportError, as on a machine without NeMo
logging.basicConfig(level=logging.INFO, format="%%(levelname)s %%(message)s")
from vllm.model_executor.models.registry import ModelRegistry
from dflash_train.vllm_plugin import register
register()
print(json.dumps({n: n in ModelRegistry.models for n in [%r, *%r]}))
""" % (SALM_ARCHITECTURE, sorted(ARCHITECTURE_ALIASES))


def test_register_without_nemo_keeps_the_draft_aliases_and_says_why():
    env = {**os.environ, "VLLM_PLUGINS": ""}  # vLLM's own plugin loading must not register anything first
    result = subprocess.run([sys.executable, "-c", WITHOUT_NEMO], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    registered = json.loads(result.stdout.strip().splitlines()[-1])
    assert registered.pop(SALM_ARCHITECTURE) is False
    assert registered and all(registered.values()), registered
    assert "NeMo's SALM vLLM support is not importable" in result.stderr and "SALM targets unavailable" in result.stderr


def test_a_tokenizer_without_the_audio_placeholder_is_a_one_line_error(served_target):
    from transformers import AutoTokenizer

    from dflash_train.vllm_plugin.salm import AUDIO_PLACEHOLDER, placeholder_token_id

    tokenizer = AutoTokenizer.from_pretrained(str(served_target))
    assert placeholder_token_id(tokenizer) == tokenizer.convert_tokens_to_ids(AUDIO_PLACEHOLDER)

    class WithoutPlaceholder:
        def get_vocab(self):
            return {token: i for token, i in tokenizer.get_vocab().items() if token != AUDIO_PLACEHOLDER}

    with pytest.raises(ValueError, match=r"the SALM tokenizer has no '<\|audio\|>' token; write the target with "
                                         "dflash-export-target") as err:
        placeholder_token_id(WithoutPlaceholder())
    assert "\n" not in str(err.value)
