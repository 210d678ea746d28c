"""Loading the real SALM target: determinism, strict weights, checks before the expensive load."""

import pytest
import torch
from conftest import compose, same_tensors, tiny_run_overrides
from safetensors.torch import load_file, save_file

from dflash_train.config import validate_config
from dflash_train.errors import ConfigError
from dflash_train.target import TargetLoadError, load_target_for_run, read_target_dims
from dflash_train.target import load as load_module
from dflash_train.testing.tiny_salm import build_tiny_salm


def _run(salm_dir, *extra):
    return validate_config(compose("dflash", tiny_run_overrides(salm_dir) + list(extra))).run


def test_builder_is_deterministic_and_reload_is_identical(tiny_salm_dir, tiny_target, tmp_path):
    again = build_tiny_salm(tmp_path / "again")
    first = load_file(str(tiny_salm_dir / "model.safetensors"))
    second = load_file(str(again / "model.safetensors"))
    assert same_tensors(first, second)
    loaded = tiny_target.salm.state_dict()
    assert all(torch.equal(loaded[k], first[k]) for k in first)
    assert (tiny_salm_dir / "llm_backbone" / "config.json").exists()
    assert (tiny_salm_dir / "tokenizer.json").exists()


def test_tiny_target_shape(tiny_target):
    assert tiny_target.num_layers == 6
    assert tiny_target.hidden_size == 64
    assert tiny_target.llm_config.head_dim >= 32
    assert tiny_target.vocab_size == 384
    assert tiny_target.tokenizer.token_to_id("<|audio|>") == tiny_target.audio_locator_tag_id


def test_load_for_run_derives_taps_and_mask(tiny_salm_dir):
    loaded = load_target_for_run(_run(tiny_salm_dir))
    assert loaded.layer_ids == [1, 3]
    assert loaded.mask_token_id == 320  # first embedding row past the 320-token tokenizer
    assert not any(p.requires_grad for p in loaded.target.parameters())
    assert not loaded.target.training


@pytest.mark.parametrize(
    "override, message",
    [
        ("dflash.target_layer_ids=[0,6]", r"\[6\] outside the target's 6 decoder blocks"),
        ("dflash.target_layer_ids=[-1,2]", r"\[-1\] outside the target's 6 decoder blocks"),
        ("dflash.mask_token_id=384", "mask_token_id=384 is outside the target vocabulary"),
        ("dflash.conv_group_size=24", "conv_group_size=24 must divide the target hidden size 64"),
        ("dflash.selector_top_k=500", "selector_top_k=500 exceeds the target vocabulary"),
        ("dflash.distill_top_k=500", "dflash.distill_top_k=500 exceeds the target vocabulary"),
    ],
)
def test_target_rules_fail_before_weights_load(tiny_salm_dir, monkeypatch, override, message):
    def must_not_load(_):
        raise AssertionError("the SALM was loaded before the config was checked")

    monkeypatch.setattr(load_module, "load_salm", must_not_load)
    with pytest.raises(ConfigError, match=message):
        load_target_for_run(_run(tiny_salm_dir, override))


def test_dims_read_from_files(tiny_salm_dir):
    dims = read_target_dims(_run(tiny_salm_dir).model)
    assert (dims.num_layers, dims.hidden_size, dims.vocab_size) == (6, 64, 384)


def test_missing_checkpoint_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no_such_salm"):
        load_target_for_run(_run(tmp_path / "no_such_salm"))


def test_audio_tag_must_match(tiny_salm_dir):
    with pytest.raises(ConfigError, match="model.audio_locator_tag='<audio>' but the target uses '<|audio|>'"):
        load_target_for_run(_run(tiny_salm_dir, "model.audio_locator_tag='<audio>'"))


def test_init_from_checkpoint_is_strict(tiny_salm_dir, tmp_path):
    state = load_file(str(tiny_salm_dir / "model.safetensors"))
    dropped = "llm.model.norm.weight"
    del state[dropped]
    state["extra.weight"] = torch.zeros(2)
    marker_key = "llm.lm_head.weight"
    state[marker_key] = torch.full_like(state[marker_key], 0.5)
    ckpt = tmp_path / "weights.safetensors"
    save_file(state, str(ckpt))

    with pytest.raises(TargetLoadError, match=rf"missing 1 key\(s\) \[{dropped}\].*unexpected 1 key\(s\) \[extra.weight\]"):
        load_target_for_run(_run(tiny_salm_dir, f"model.init_from_checkpoint={ckpt}"))

    loaded = load_target_for_run(
        _run(tiny_salm_dir, f"model.init_from_checkpoint={ckpt}", "model.init_from_checkpoint_strict=false")
    )
    assert torch.equal(loaded.target.lm_head.weight, torch.full_like(loaded.target.lm_head.weight, 0.5))


def test_init_from_checkpoint_shape_mismatch_always_fails(tiny_salm_dir, tmp_path):
    state = load_file(str(tiny_salm_dir / "model.safetensors"))
    state["llm.lm_head.weight"] = torch.zeros(3, 3)
    ckpt = tmp_path / "bad.safetensors"
    save_file(state, str(ckpt))
    with pytest.raises(TargetLoadError, match=r"shape mismatch .*llm.lm_head.weight: checkpoint \(3, 3\) vs model \(384, 64\)"):
        load_target_for_run(
            _run(tiny_salm_dir, f"model.init_from_checkpoint={ckpt}", "model.init_from_checkpoint_strict=false")
        )


def test_build_from_salm_config_keys(tiny_salm_dir):
    import json

    salm_cfg = json.loads((tiny_salm_dir / "config.json").read_text())
    salm_cfg["pretrained_llm"] = str(tiny_salm_dir / "llm_backbone")
    salm_cfg["tokenizer_path"] = str(tiny_salm_dir)
    for key in ("model_type", "architectures"):
        salm_cfg.pop(key)
    cfg = compose("dflash", tiny_run_overrides(tiny_salm_dir) + [f"model.init_from_checkpoint={tiny_salm_dir}"])
    cfg.model.pretrained_name = None
    cfg.model.salm = salm_cfg
    run = validate_config(cfg).run
    loaded = load_target_for_run(run)
    reference = load_file(str(tiny_salm_dir / "model.safetensors"))
    state = loaded.target.salm.state_dict()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_encoder_chunk_size_reaches_the_target(tiny_salm_dir):
    loaded = load_target_for_run(_run(tiny_salm_dir, "model.encoder_chunk_size_seconds=2.5"))
    assert loaded.target.salm.cfg.encoder_chunk_size_seconds == 2.5


class _RunsCode:
    """A pickle payload that, if unpickled, would create a file (stands in for arbitrary code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_and_a_plain_one_loads(tiny_salm_dir, tmp_path):
    state = load_file(str(tiny_salm_dir / "model.safetensors"))
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": state, "global_step": 3, "epoch": 0}, plain)  # tensors and plain containers
    loaded = load_target_for_run(_run(tiny_salm_dir, f"model.init_from_checkpoint={plain}"))
    assert torch.equal(loaded.target.lm_head.weight, state["llm.lm_head.weight"])

    marker = tmp_path / "code_ran"
    hostile = tmp_path / "hostile.ckpt"
    torch.save({"state_dict": state, "payload": _RunsCode(marker)}, hostile)
    with pytest.raises(TargetLoadError, match=r"init_from_checkpoint='.*hostile.ckpt' holds pickled Python objects "
                                              r"beyond tensors .*refused: save its state_dict as .safetensors"):
        load_target_for_run(_run(tiny_salm_dir, f"model.init_from_checkpoint={hostile}"))
    assert not marker.exists(), "unpickling ran the payload"


def test_no_load_error_recommends_turning_strictness_off(tiny_salm_dir, tmp_path):
    state = load_file(str(tiny_salm_dir / "model.safetensors"))
    del state["llm.model.norm.weight"]
    ckpt = tmp_path / "weights.safetensors"
    save_file(state, str(ckpt))
    with pytest.raises(TargetLoadError) as err:
        load_target_for_run(_run(tiny_salm_dir, f"model.init_from_checkpoint={ckpt}"))
    assert "strict=false" not in str(err.value) and "architecture" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_checkpoint_loads_straight_into_the_compute_dtype_as_nemo_would_cast_it(tiny_salm_dir, dtype):
    """The direct load (meta parameters, tensors cast as read) gives NeMo's FP32 load cast to ``dtype``, bit for
    bit: every parameter and every buffer, the non-persistent ones (rotary frequencies) included."""
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.config import ModelConfig
    from dflash_train.target.salm import load_salm

    direct = load_salm(ModelConfig(pretrained_name=str(tiny_salm_dir)), dtype)
    cast = SALM.from_pretrained(str(tiny_salm_dir)).to(dtype)
    for kind in ("named_parameters", "named_buffers"):
        ours, theirs = dict(getattr(direct, kind)()), dict(getattr(cast, kind)())
        assert ours.keys() == theirs.keys() and ours
        for name, tensor in ours.items():
            assert tensor.device.type == "cpu" and tensor.dtype == theirs[name].dtype, name
            assert torch.equal(tensor, theirs[name]), name
    assert {p.dtype for p in direct.parameters()} == {dtype} and not direct.training


def test_tied_weights_load_as_one_tensor(tmp_path):
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.config import ModelConfig
    from dflash_train.target.salm import load_salm
    from dflash_train.testing.tiny_salm import TinySALMSpec

    tied_dir = build_tiny_salm(tmp_path / "tied", TinySALMSpec(tie_word_embeddings=True, lm_head_std=None))
    assert "llm.lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))  # stored once
    salm = load_salm(ModelConfig(pretrained_name=str(tied_dir)), torch.bfloat16)
    assert salm.llm.lm_head.weight.data_ptr() == salm.embed_tokens.weight.data_ptr()
    nemo = SALM.from_pretrained(str(tied_dir)).to(torch.bfloat16)
    assert torch.equal(salm.llm.lm_head.weight, nemo.llm.lm_head.weight) and salm.embed_tokens.weight.dtype == torch.bfloat16


def test_the_hub_notice_is_dropped_unless_verbose(tiny_salm_dir, capfd, monkeypatch):
    """huggingface_hub prints "Loading weights from local directory" on every rank: dropped; DFLASH_VERBOSE=1 keeps it."""
    from dflash_train.config import ModelConfig
    from dflash_train.target.salm import HUB_NOTICE, load_salm

    load_salm(ModelConfig(pretrained_name=str(tiny_salm_dir)))
    assert HUB_NOTICE not in capfd.readouterr().out
    monkeypatch.setenv("DFLASH_VERBOSE", "1")
    load_salm(ModelConfig(pretrained_name=str(tiny_salm_dir)))
    assert HUB_NOTICE in capfd.readouterr().out
