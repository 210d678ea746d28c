"""Variant behaviour checked against computations written here: DFlash2's selector terms, warm starts."""

import json
import math

import pytest
import torch
from conftest import UTTERANCES, chatml_speech_batch, compose, tiny_run_overrides

from dflash_train.config import validate_config
from dflash_train.draft import DraftSpec, build_draft, write_export
from dflash_train.draft.build import warm_start
from dflash_train.errors import ConfigError
from dflash_train.training.module import DFlashDraftModule, ModuleSettings

BLOCK = 4
LAYERS = (1, 3)
MASK_ID = 320


def _dflash_cfg(tiny_salm_dir, variant="dflash2", *extra):
    overrides = tiny_run_overrides(tiny_salm_dir) + [f"dflash={variant}", f"dflash.block_size={BLOCK}", *extra]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16"]
    return validate_config(compose("dflash", overrides)).run.dflash


def _spec(cfg, target, mask_token_id=MASK_ID, layers=LAYERS):
    return DraftSpec(cfg, layers, mask_token_id, target.num_layers)


def test_dflash2_selector_loss_and_candidate_recall_match_a_direct_computation(tiny_salm_dir, tiny_target,
                                                                                  speech_batch):
    top_k = tiny_target.vocab_size // 8
    cfg = _dflash_cfg(tiny_salm_dir, "dflash2", f"dflash.selector_top_k={top_k}")
    spec = _spec(cfg, tiny_target)
    torch.manual_seed(0)
    draft = build_draft(tiny_target.llm_config, spec, "sdpa")
    module = DFlashDraftModule(tiny_target, draft, spec, ModuleSettings(layer_ids=list(LAYERS)))
    inputs = module.prepare(chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values())))
    seen = {}
    sample = module.core._sample_anchor_positions
    module.core._sample_anchor_positions = lambda *a, **k: seen.setdefault("anchors", sample(*a, **k))
    draft.register_forward_hook(lambda mod, args, kwargs, out: seen.setdefault("hidden", out.detach()), with_kwargs=True)
    with torch.no_grad():
        metrics = module.run_core(inputs, rng_key=5)

    anchors, keep = seen["anchors"]
    batch, blocks = anchors.shape
    hidden = seen["hidden"].view(batch, blocks, BLOCK, -1)
    with torch.no_grad():
        logits = draft.compute_logits(seen["hidden"], tiny_target.lm_head).view(batch, blocks, BLOCK, -1)
    selector = draft.candidate_selector
    ids, mask, length = inputs.input_ids, inputs.loss_mask, inputs.input_ids.shape[1]
    weighted_nll = weight_sum = supervised = recalled = ce_weight = 0.0
    for row in range(batch):
        for block in range(blocks):
            if not keep[row, block]:
                continue
            anchor = int(anchors[row, block])
            for k in range(1, BLOCK):  # block position k predicts the token at anchor + k
                position = anchor + k
                if position >= length or not mask[row, position]:
                    continue
                supervised += 1
                ce_weight += math.exp(-(k - 1) / cfg.loss_decay_gamma)
                values, candidates = logits[row, block, k].topk(top_k)
                truth = int(ids[row, position])
                if truth not in candidates.tolist():
                    continue
                recalled += 1
                previous = int(ids[row, position - 1])
                gate = selector.predecessor_codebook[previous] * selector.hidden_projection(hidden[row, block, k])
                scores = values + selector.successor_codebook[candidates] @ gate
                nll = -torch.log_softmax(scores.double(), dim=-1)[candidates.tolist().index(truth)]
                weight = math.exp(-(k - 1) / cfg.loss_decay_gamma)
                weighted_nll += weight * float(nll)
                weight_sum += weight
    assert 0 < recalled < supervised, "the check needs positions both inside and outside the candidate lists"
    assert float(metrics.candidate_recall) == pytest.approx(recalled / supervised, rel=1e-6)
    assert float(metrics.selector_loss) == pytest.approx(weighted_nll / (weight_sum + 1e-6), rel=1e-4)
    # the step loss: block CE + λ · the selector's mean NLL over candidate-covered positions (one process; the
    # mean over several ranks' rows is tests/test_distributed.py's)
    assert float(metrics.loss_weight) == pytest.approx(ce_weight, rel=1e-6)
    expected = float(metrics.base_loss) + cfg.selector_loss_weight * weighted_nll / weight_sum
    assert float(metrics.loss) == pytest.approx(expected, rel=1e-5)
    logged = spec.variant.step_metrics(metrics)
    assert float(logged["candidate_recall"]) == float(metrics.candidate_recall)
    assert float(logged["selector_loss"]) == float(metrics.selector_loss)


def _export(tiny_target, cfg, out, mask_token_id=MASK_ID, layers=LAYERS):
    spec = _spec(cfg, tiny_target, mask_token_id, layers)
    draft = build_draft(tiny_target.llm_config, spec, "sdpa")
    return write_export(out, draft.config, draft.state_dict())


def _warm_start_into(tiny_target, cfg, export_dir, mask_token_id=MASK_ID):
    spec = _spec(cfg, tiny_target, mask_token_id)
    warm_start(build_draft(tiny_target.llm_config, spec, "sdpa"), str(export_dir), spec)


def test_warm_start_loads_a_matching_export(tiny_salm_dir, tiny_target, tmp_path):
    cfg = _dflash_cfg(tiny_salm_dir)
    export = _export(tiny_target, cfg, tmp_path / "ok")
    _warm_start_into(tiny_target, cfg, export)


def test_warm_start_from_a_directory_that_is_not_an_export(tiny_salm_dir, tiny_target, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.ckpt").write_text("not an export")
    with pytest.raises(ConfigError, match=r"init_from_pretrained='.*ckpt' is not a draft export"):
        _warm_start_into(tiny_target, _dflash_cfg(tiny_salm_dir), tmp_path / "ckpt")


def test_warm_start_from_another_variant_names_both(tiny_salm_dir, tiny_target, tmp_path):
    export = _export(tiny_target, _dflash_cfg(tiny_salm_dir, "dflash"), tmp_path / "dflash")
    with pytest.raises(ConfigError, match="is a dflash draft but this run trains dflash2; choose dflash=dflash"):
        _warm_start_into(tiny_target, _dflash_cfg(tiny_salm_dir, "dflash2"), export)


def test_warm_start_with_another_mask_token_names_the_key(tiny_salm_dir, tiny_target, tmp_path):
    cfg = _dflash_cfg(tiny_salm_dir)
    export = _export(tiny_target, cfg, tmp_path / "m", mask_token_id=MASK_ID)
    with pytest.raises(ConfigError, match=f"trained with mask_token_id={MASK_ID} but this run uses 5; "
                                          f"set dflash.mask_token_id={MASK_ID}"):
        _warm_start_into(tiny_target, cfg, export, mask_token_id=5)


def test_warm_start_with_another_selector_shape_names_the_key(tiny_salm_dir, tiny_target, tmp_path):
    export = _export(tiny_target, _dflash_cfg(tiny_salm_dir, "dflash2", "dflash.selector_top_k=8"), tmp_path / "s")
    with pytest.raises(ConfigError, match="trained with selector_top_k=8 but this run uses 4; set dflash.selector_top_k=8"):
        _warm_start_into(tiny_target, _dflash_cfg(tiny_salm_dir, "dflash2", "dflash.selector_top_k=4"), export)


def test_a_missing_nemo_automodel_names_the_install_line(monkeypatch):
    import sys

    from dflash_train.errors import MissingDependencyError
    from dflash_train.variants import VARIANTS

    monkeypatch.setitem(sys.modules, "nemo_automodel.components.speculative", None)
    for variant in [v for v in VARIANTS.values() if v.family == "block"]:  # MTP heads are our own module
        with pytest.raises(MissingDependencyError, match=r"install them with `pip install --no-deps nemo-automodel==0\.7\.0`"):
            variant.load_classes()


def _rewrite_export(export, config_change=None, weights_change=None):
    from safetensors.torch import load_file, save_file

    config = json.loads((export / "config.json").read_text())
    if config_change:
        config_change(config)
        (export / "config.json").write_text(json.dumps(config))
    if weights_change:
        weights = load_file(str(export / "model.safetensors"))
        save_file(weights_change(weights), str(export / "model.safetensors"))
    return export


def test_warm_start_from_a_draft_with_other_rotary_settings_names_them(tiny_salm_dir, tiny_target, tmp_path):
    cfg = _dflash_cfg(tiny_salm_dir)
    export = _rewrite_export(
        _export(tiny_target, cfg, tmp_path / "r"), lambda c: c.update(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    )
    with pytest.raises(ConfigError, match=r"trained with rotary settings \{'rope_theta': 1000000.0.*but this run's draft uses"):
        _warm_start_into(tiny_target, cfg, export)


def test_warm_start_refuses_a_quantized_artifact(tiny_salm_dir, tiny_target, tmp_path):
    import torch

    cfg = _dflash_cfg(tiny_salm_dir)
    declared = _rewrite_export(
        _export(tiny_target, cfg, tmp_path / "q"), lambda c: c.update(quantization_config={"quant_method": "modelopt"})
    )
    with pytest.raises(ConfigError, match="is a quantized artifact .*modelopt.*trainable floating-point export"):
        _warm_start_into(tiny_target, cfg, declared)
    packed = _rewrite_export(
        _export(tiny_target, cfg, tmp_path / "p"),
        weights_change=lambda w: {k: (v.to(torch.float8_e4m3fn) if k == "fc.weight" else v) for k, v in w.items()},
    )
    with pytest.raises(ConfigError, match="holds torch.float8_e4m3fn tensors .*trainable floating-point export"):
        _warm_start_into(tiny_target, cfg, packed)
