"""Nemotron-H SpeechLM targets (Mamba-2, attention, MLP and MoE blocks): loading either name set strictly,
agreement with nemo_automodel's own model, packed rows isolated per document, rollback of Mamba state in
the reference decoder, and a draft config free of the target's own keys."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch
from conftest import HYBRID_PATTERN, compose, same_tensors, tiny_run_overrides
from safetensors.torch import load_file, save_file
from test_eval_decoder import TargetOracle

from dflash_train.config import validate_config
from dflash_train.config.schema import ModelConfig
from dflash_train.data.packing import document_layout
from dflash_train.errors import ConfigError
from dflash_train.evaluate.decoder import StopRule, greedy_decode, speculative_decode
from dflash_train.evaluate.session import TargetSession, crop_cache
from dflash_train.target import open_speech_target
from dflash_train.target.taps import tap_decoder
from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm

TAPS = [0, 3, 6, 7]  # a Mamba, an MoE, a Mamba and the last (MoE) block
K = 3


def test_the_tiny_target_has_every_block_kind_and_native_names(tiny_hybrid_dir, tiny_hybrid_target):
    kinds = [layer.block_type for layer in tiny_hybrid_target.decoder_layers]
    assert kinds == ["linear_attention", "full_attention", "mlp", "moe", "linear_attention", "full_attention",
                     "linear_attention", "moe"]
    assert tiny_hybrid_target.recurrent_block_ids == [0, 4, 6]
    names = set(load_file(str(tiny_hybrid_dir / "model.safetensors")))
    assert "llm.model.layers.0.mixer._fp32_params.A_log" in names and "llm.model.layers.0.mixer.A_log" not in names
    assert "llm.model.layers.3.mixer.experts.gate_and_up_projs" in names
    assert any(name.endswith("._extra_state") for name in names)


def test_hf_and_native_names_load_the_same_llm(tiny_hybrid_target, tmp_path):
    hf_dir = build_tiny_mtp_salm(tmp_path / "hf", TinyMTPSpec(backbone_pattern=HYBRID_PATTERN))
    assert "llm.model.layers.3.mixer.experts.up_proj" in load_file(str(hf_dir / "model.safetensors"))
    from_hf = open_speech_target(ModelConfig(pretrained_name=str(hf_dir)))
    assert same_tensors(from_hf.state_dict(), tiny_hybrid_target.state_dict())


@pytest.mark.parametrize("change, named", [
    ("drop", "model.layers.4.mixer.D"),
    ("extra", "model.layers.2.mixer.extra_weight"),
])
def test_a_tensor_missing_or_left_over_fails_in_one_line_naming_it(tiny_hybrid_dir, tmp_path, change, named):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hybrid_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    if change == "drop":
        del weights["llm.model.layers.4.mixer._fp32_params.D"]
    else:
        weights["llm.model.layers.2.mixer.extra_weight"] = torch.zeros(2)
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        open_speech_target(ModelConfig(pretrained_name=str(broken)))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_of_nemo_automodels_own_nemotron_h_loads_and_gives_its_logits(tiny_hybrid_dir, tmp_path):
    """nemo_automodel's NemotronH (the LLM SALMAutomodel builds; on CPU a Mamba-free pattern) writes the native
    names; the target loaded from them computes nemo_automodel's logits."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.nemotron_v3.model import NemotronHForCausalLM
    from transformers import AutoConfig, NemotronHConfig

    pattern = "*-E*E"
    target_dir = tmp_path / "automodel"
    shutil.copytree(tiny_hybrid_dir, target_dir)
    stored = AutoConfig.from_pretrained(target_dir / "llm_backbone").to_dict()
    stored.update(hybrid_override_pattern=pattern, num_nextn_predict_layers=0)
    stored.pop("layers_block_type"), stored.pop("mtp_layers_block_type", None)
    config = NemotronHConfig(**stored)
    config.save_pretrained(target_dir / "llm_backbone")
    torch.manual_seed(3)
    backend = BackendConfig(linear="torch", rms_norm="torch", attn="sdpa", experts="torch", dispatcher="torch",
                            enable_hf_state_dict_adapter=False)
    automodel = NemotronHForCausalLM(config, backend).float().eval()
    for name, param in automodel.named_parameters():  # weights large enough that every block changes the logits
        if param.dim() > 1:
            param.data.normal_(0, 0.3)
    perception = {k: v for k, v in load_file(str(tiny_hybrid_dir / "model.safetensors")).items()
                  if k.startswith("perception.")}
    native = {f"llm.{k}": v.contiguous() for k, v in automodel.state_dict().items()}
    assert "llm.model.layers.2.mixer.experts.gate_and_up_projs" in native
    save_file({**perception, **native}, str(target_dir / "model.safetensors"))

    target = open_speech_target(ModelConfig(pretrained_name=str(target_dir)))
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = automodel(input_ids=ids).logits.float()
        ours = target.causal_lm(input_ids=ids).logits
    scale, difference = theirs.abs().max().item(), (ours - theirs).abs().max().item()
    print(f"nemo_automodel's NemotronH ({pattern}) vs this target: logits differ by {difference:.3g} (scale {scale:.3g})")
    assert scale > 1 and difference <= 1e-5 * scale


def _packed_rows(target, dtype):
    """Two rows of packed documents (BSHD) and the same documents as one row (THD), with random embeddings."""
    lengths = [[9, 6, 4], [5, 11]]
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randn(n, target.hidden_size, generator=generator, dtype=dtype) for row in lengths for n in row]
    width = max(sum(row) for row in lengths) + 2
    bshd = torch.zeros(len(lengths), width, target.hidden_size, dtype=dtype)
    bshd_ids = torch.full((len(lengths), width), -1)
    index = 0
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            bshd[r, start:start + n], bshd_ids[r, start:start + n] = docs[index], d
            start, index = start + n, index + 1
    thd = torch.cat(docs)[None]
    thd_ids = torch.cat([torch.full((len(doc),), d) for d, doc in enumerate(docs)])[None]
    return docs, [(bshd, bshd_ids), (thd, thd_ids)]


def _worst_isolation_error(target, docs, rows, forward) -> tuple[float, float]:
    """Largest |packed - alone| over every document's taps and final hidden state, and the taps' scale."""
    worst, scale = 0.0, 0.0
    for embeds, doc_ids in rows:
        out = forward(embeds, doc_ids)
        flat_docs = [(r, d) for r in range(doc_ids.shape[0]) for d in range(int(doc_ids[r].max()) + 1)]
        for (r, d), doc in zip(flat_docs, docs):
            alone = target.forward_taps(doc[None], None, TAPS, return_last_hidden=True)
            where = doc_ids[r] == d
            worst = max(worst, (out.features[r, where] - alone.features[0]).abs().max().item(),
                        (out.last_hidden[r, where] - alone.last_hidden[0]).abs().max().item())
            scale = max(scale, alone.features.abs().max().item())
    return worst, scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_packed_document_equals_that_document_alone(tiny_hybrid_target, dtype):
    """BSHD and THD rows equal each document run alone to 1e-6 of the taps' scale: float32's rounding (HF's
    MoE router computes in float32 whatever the model's dtype, so float64 is no tighter). The attention-mask
    route alone (what a Qwen target uses) lets Mamba state run into the next document."""
    target = tiny_hybrid_target.to(dtype)
    experts = target.llm.config._experts_implementation
    target.llm.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    try:
        docs, rows = _packed_rows(target, dtype)

        def packed(embeds, doc_ids):
            return target.forward_taps(embeds, None, TAPS, return_last_hidden=True,
                                       position_ids=document_layout(doc_ids).position_ids, document_ids=doc_ids)

        def mask_only(embeds, doc_ids):
            return tap_decoder(target.decoder, target.decoder_layers, embeds, None, TAPS, return_last_hidden=True,
                               position_ids=document_layout(doc_ids).position_ids, document_ids=doc_ids)

        worst, scale = _worst_isolation_error(target, docs, rows, packed)
        leaked, _ = _worst_isolation_error(target, docs, rows, mask_only)
    finally:
        target.to(torch.float32)
        target.llm.set_experts_implementation(experts)
    print(f"packed isolation ({dtype}): mask only {leaked:.3g}, documents apart {worst:.3g} (tap scale {scale:.3g})")
    assert leaked > 1e-2 * scale
    assert worst <= 1e-6 * scale


@pytest.fixture(scope="module")
def prompts(tiny_hybrid_target):
    ids = [torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed)) for seed, n in
           ((0, 30), (1, 41), (2, 17), (3, 24))]
    return [tiny_hybrid_target.embed_tokens(i) for i in ids]


def test_the_reference_decoder_rolls_back_mamba_state_exactly(tiny_hybrid_target, prompts):
    """Round r accepts r % (K+1) proposals; the output equals target-only greedy and the counters are exact."""
    rule = StopRule(36, frozenset())
    pattern = lambda r: r % (K + 1)  # noqa: E731
    for embeds in prompts:
        reference = greedy_decode(TargetSession(tiny_hybrid_target, rolls_back=False), embeds, rule)
        oracle = TargetOracle(tiny_hybrid_target, K, wrong_at=lambda r: pattern(r) if pattern(r) < K else None)
        out = speculative_decode(TargetSession(tiny_hybrid_target, TAPS), oracle, embeds, rule)
        assert len(set(reference.token_ids)) > 3, "the target repeats one token: nothing to compare"
        assert out.token_ids == reference.token_ids
        assert out.accepted_per_round == [pattern(r) for r in range(len(out.accepted_per_round))]


def test_a_greedy_session_keeps_no_copy_of_the_mamba_state_and_refuses_a_crop(tiny_hybrid_target, prompts):
    """Greedy decoding never rolls back: no deep copy of the cache per request (a rolling-back session makes one)."""
    greedy, rolling = TargetSession(tiny_hybrid_target, rolls_back=False), TargetSession(tiny_hybrid_target)
    for session in (greedy, rolling):
        session.prefill(prompts[0])
        session.extend([5, 6, 7])
    assert greedy._rollback_point is None and rolling._rollback_point is not None
    with pytest.raises(RuntimeError, match="rolls_back=False"):
        greedy.crop(greedy.length - 1)


def test_a_mamba_cache_cannot_be_cropped_so_the_session_replays(tiny_hybrid_target, prompts):
    session = TargetSession(tiny_hybrid_target)
    session.prefill(prompts[0])
    session.extend([5, 6, 7])
    with pytest.raises(RuntimeError, match="crop"):
        crop_cache(session.cache, session.length - 2)  # transformers' own rollback refuses a recurrent state
    replayed = TargetSession(tiny_hybrid_target)
    replayed.prefill(prompts[0])
    replayed.extend([5, 6, 7])
    replayed.crop(replayed.length - 2)
    straight = TargetSession(tiny_hybrid_target)
    straight.prefill(prompts[0])
    straight.extend([5])
    assert replayed.length == straight.length
    after_replay, after_straight = replayed.extend([9]), straight.extend([9])
    assert torch.allclose(after_replay.logits, after_straight.logits, atol=1e-5, rtol=0)


def test_the_draft_config_carries_only_draft_keys(tiny_hybrid_target):
    from transformers import Qwen3Config

    from dflash_train.draft.build import DraftSpec, build_draft_config

    run = validate_config(compose("dflash", tiny_run_overrides("unused") + ["dflash=dflash"])).run
    spec = DraftSpec(run.dflash, (1, 5), 320, tiny_hybrid_target.num_layers)
    config = build_draft_config(tiny_hybrid_target.llm_config, spec, "sdpa").to_dict()
    foreign = set(config) - set(Qwen3Config().to_dict()) - {"num_target_layers", "dflash_config"}
    assert not foreign, f"target keys in the draft config: {sorted(foreign)}"
    assert config["hidden_size"] == tiny_hybrid_target.hidden_size
    assert config["rms_norm_eps"] == tiny_hybrid_target.llm_config.layer_norm_epsilon


def _model_keys(*overrides):
    return validate_config(compose("dflash", tiny_run_overrides("/x") + ["model=salm_automodel", *overrides])).run


def test_nemos_model_keys_keep_their_meaning(caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_train.config.nemo_model"):
        run = _model_keys("model.prompt_format=nemotron-nano-v3", "+model.freeze_params=[llm]",
                          "+model.optimizer={lr:1e-4}")
    assert run.data.prompt_format == "nemotron_nano_v3"
    assert "model.freeze_params/optimizer steer training the SpeechLM itself" in caplog.text
    built = validate_config(compose("dflash", ["model.pretrained_name=null", "+model.pretrained_llm=/llm",
                                               "+model.pretrained_asr=/asr", "data.train_ds.input_cfg=[]"])).run
    assert built.model.salm["pretrained_llm"] == "/llm" and built.model.salm["pretrained_asr"] == "/asr"


@pytest.mark.parametrize("overrides, message", [
    (["data.prompt_format=qwen"], "model.prompt_format='nemotron-nano-v3' and data.prompt_format='qwen' disagree"),
    (["model.pretrained_name=null", "model.pretrained_llm=/llm"],
     "model.use_nemo_automodel=true without model.pretrained_name builds SALMAutomodel"),
])
def test_contradicting_or_gpu_only_model_keys_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _model_keys(*overrides)


def test_init_from_checkpoint_reads_either_name_set_into_a_nemotron_h_target(tiny_hybrid_dir, tmp_path):
    changed = load_file(str(tiny_hybrid_dir / "model.safetensors"))
    changed["llm.model.layers.3.mixer.experts.gate_and_up_projs"] = changed[
        "llm.model.layers.3.mixer.experts.gate_and_up_projs"] * 2
    save_file(changed, str(tmp_path / "weights.safetensors"))
    target = open_speech_target(dataclasses.replace(
        ModelConfig(pretrained_name=str(tiny_hybrid_dir)), init_from_checkpoint=str(tmp_path / "weights.safetensors")))
    expected = changed["llm.model.layers.3.mixer.experts.gate_and_up_projs"].transpose(1, 2)
    assert torch.equal(target.llm.model.layers[3].mixer.experts.up_proj, expected)
    config = json.loads((tiny_hybrid_dir / "config.json").read_text())
    assert target.audio_locator_tag == config["audio_locator_tag"]


def test_a_nemotron_h_target_with_another_audio_tag_fails_in_one_line(tiny_hybrid_dir):
    with pytest.raises(ConfigError, match=r"model.audio_locator_tag='<audio>' but the target uses '<\|audio\|>'"):
        open_speech_target(ModelConfig(pretrained_name=str(tiny_hybrid_dir), audio_locator_tag="<audio>"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_nemotron_h_target_loads_straight_into_its_dtype_as_an_fp32_build_would_cast_it(tiny_hybrid_dir, dtype):
    """Built without weights and assigned the checkpoint's tensors cast as read: every parameter and buffer
    bit-equal to modules built the ordinary way (random init), loaded in FP32, then cast."""
    from nemo.collections.speechlm2.modules import AudioPerceptionModule
    from omegaconf import DictConfig
    from transformers import AutoConfig, NemotronHForCausalLM

    from dflash_train.target.nemotron_h import hf_llm_state

    weights = load_file(str(tiny_hybrid_dir / "model.safetensors"))
    llm = NemotronHForCausalLM(AutoConfig.from_pretrained(tiny_hybrid_dir / "llm_backbone")).float()
    llm.load_state_dict(hf_llm_state(weights), strict=True)
    config = json.loads((tiny_hybrid_dir / "config.json").read_text())
    perception = AudioPerceptionModule(DictConfig(config["perception"]))
    perception.load_state_dict({k[len("perception."):]: v for k, v in weights.items() if k.startswith("perception.")})
    target = open_speech_target(ModelConfig(pretrained_name=str(tiny_hybrid_dir)), dtype)
    assert target.embed_tokens.weight.dtype == dtype
    for ours, theirs in ((target.llm, llm.to(dtype)), (target.perception, perception.to(dtype))):
        assert same_tensors({**dict(ours.named_parameters()), **dict(ours.named_buffers())},
                            {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())})
