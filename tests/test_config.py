"""Every shipped YAML composes and validates; every rule rejects a bad value with its message."""

from pathlib import Path

import pytest
from conftest import compose

from dflash_train.config import missing_keys, validate_config
from dflash_train.constants import CONFIG_DIR
from dflash_train.errors import ConfigError
from dflash_train.variants import DFlash2Config

CONF = CONFIG_DIR
PRIMARY_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml"))
GROUP_OPTIONS = sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml"))
VALID = ["model.pretrained_name=/ckpt/salm", "data.train_ds.input_cfg=[]"]


def test_primary_configs_are_the_expected_ones():
    assert PRIMARY_CONFIGS == ["demo", "dflash", "dflash_local"]


@pytest.mark.parametrize("name", PRIMARY_CONFIGS)
def test_every_primary_config_composes_and_validates(name):
    cfg = compose(name)
    if name == "dflash":
        assert missing_keys(cfg) == ["model.pretrained_name", "data.train_ds.input_cfg"]
        cfg = compose(name, VALID)
    run, trainer_kwargs = validate_config(cfg)
    assert run.dflash.block_size >= 2 and "max_steps" in trainer_kwargs


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_group_option_composes_into_the_recipe(group, option):
    validate_config(compose("dflash", VALID + [f"{group}={option}"]))


def test_recipe_defaults():
    cfg = compose("dflash", VALID)
    run, trainer_kwargs = validate_config(cfg)
    d = run.dflash
    assert isinstance(d, DFlash2Config) and d.variant == "dflash2"
    assert (d.block_size, d.loss_decay_gamma, d.num_anchors) == (8, 4.0, 512)
    assert (d.label_source, d.projection_only, d.draft_num_hidden_layers) == ("target_argmax", False, 6)
    assert (d.target_layer_ids, d.init_from_pretrained, d.lr, d.loss_chunk_size) == (None, None, 6.0e-4, 256)
    assert run.trainer.precision == "bf16-flash"
    assert run.exp_manager.resume_if_exists is True
    assert run.model.init_from_checkpoint_strict is True
    assert run.model.audio_locator_tag == "<|audio|>"
    assert (run.trainer.strategy.tp_size, run.trainer.strategy.pp_size, run.trainer.strategy.cp_size) == (1, 1, 1)
    assert trainer_kwargs["use_distributed_sampler"] is False


def test_user_config_inherits_recipe():
    run, _ = validate_config(compose("dflash_local"))
    assert run.model.pretrained_name == "/path/to/salm_checkpoint"
    assert run.dflash.block_size == 8 and run.dflash.variant == "dflash2"


def test_bf16_automodel_is_an_alias():
    run, _ = validate_config(compose("dflash", VALID + ["trainer.precision=bf16-automodel"]))
    assert run.trainer.precision == "bf16-flash"


def test_dflash_group_selects_the_variant_schema():
    run, _ = validate_config(compose("dflash", VALID + ["dflash=dflash"]))
    assert type(run.dflash).__name__ == "DFlashConfig" and not hasattr(run.dflash, "selector_rank")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+dflash.blok_size=4"], "unknown config key 'dflash.blok_size'; did you mean 'block_size'?"),
        (["+trainer.max_stepz=4"], "unknown config key 'trainer.max_stepz'; did you mean 'max_steps'?"),
        (["+model.pretrained_nam=x"], "unknown config key 'model.pretrained_nam'; did you mean 'pretrained_name'?"),
        (["+exp_manager.resume=true"], "unknown config key 'exp_manager.resume'"),
        (["+foo=1"], "unknown config key 'foo'"),
        (["dflash.variant=dflash"], "belongs to variant dflash2, not dflash; choose the variant with the config group"),
        (["dflash.variant=eagle"], "dflash.variant='eagle' is not a known variant"),
        (["dflash.block_size=abc"], "config key 'dflash.block_size'"),
        (["trainer.strategy.tp_size=2"], "trainer.strategy.tp_size=2 is not supported"),
        (["trainer.strategy.pp_size=2"], "trainer.strategy.pp_size=2 is not supported"),
        (["trainer.strategy.cp_size=4"], "trainer.strategy.cp_size=4 is not supported"),
        (["trainer.strategy.ep_size=0"], "trainer.strategy.ep_size=0 must be >= 1"),
        (["dflash.anchor_budget=per_batch"], "dflash.anchor_budget='per_batch' is unknown; choose one of"),
        (["dflash.step_loss_weights=[1.0,0.5]"], "dflash.step_loss_weights=[1.0, 0.5] must list 7 non-negative weights"),
        (["dflash.step_loss_weights=[1,1,1,1,1,1,1]", "dflash.loss_chunk_size=0"],
         "dflash.step_loss_weights with dflash.loss_chunk_size=0: the library's own loss"),
        (["dflash.loss_ce_weight=0"], "dflash.loss_ce_weight / loss_kl_weight / loss_tv_weight = 0.0, 0.0, 0.0 must be"),
        (["dflash.loss_kl_weight=-1"], "dflash.loss_ce_weight / loss_kl_weight / loss_tv_weight = 1.0, -1.0, 0.0 must be"),
        (["dflash.distill_temperature=0"], "dflash.distill_temperature=0.0 must be > 0"),
        (["dflash.distill_top_k=-2"], "dflash.distill_top_k=-2 must be >= 0"),
        (["dflash.loss_tv_weight=1", "dflash.loss_chunk_size=0"],
         "dflash.loss_kl_weight / loss_tv_weight (distillation) with dflash.loss_chunk_size=0: only the chunked loss"),
        (["trainer.strategy.name=megatron"], "trainer.strategy.name='megatron' is unknown"),
        (["trainer.precision=16-mixed"], "trainer.precision='16-mixed' is not supported; use a BF16 mode"),
        (["trainer.precision=32"], "trainer.precision='32' is not supported"),
        (["dflash.loss_chunk_size=-1"], "dflash.loss_chunk_size=-1 must be >= 0"),
        (["dflash.use_fused_linear_ce=true"],
         "dflash.use_fused_linear_ce=true: NeMo's fused linear cross-entropy is not run here; the chunked loss replaces it"),
        (["dflash.projection_only=true"], "dflash.projection_only=true requires dflash.init_from_pretrained"),
        (
            ["dflash=dflash", "dflash.projection_only=true", "dflash.init_from_pretrained=/d"],
            "dflash.projection_only=true requires dflash.variant=dflash2",
        ),
        (["dflash.block_size=1"], "dflash.block_size=1 must be >= 2"),
        (["dflash.mask_token_id=-3"], "dflash.mask_token_id=-3 must be a non-negative token id"),
        (["dflash.label_source=teacher"], "dflash.label_source='teacher' is unknown"),
        (["dflash.attention_backend=eager"], "dflash.attention_backend='eager' is unknown"),
        (["dflash.loss_decay_gamma=0"], "dflash.loss_decay_gamma=0.0 must be > 0"),
        (["dflash.num_anchors=0"], "dflash.num_anchors=0 must be >= 1"),
        (["dflash.lr=0"], "dflash.lr=0.0 must be > 0"),
        (["dflash.nonfinite_step_limit=0"], "dflash.nonfinite_step_limit=0 must be >= 1"),
        (["dflash.draft_num_hidden_layers=0"], "dflash.draft_num_hidden_layers=0 must be >= 1"),
        (["dflash.target_layer_ids=[2,2]"], "repeats a layer"),
        (["dflash.target_layer_ids=[]"], "dflash.target_layer_ids is empty"),
        (["+dflash.draft_model_config.num_hidden_layers=3"], "draft_model_config.num_hidden_layers is managed"),
        (["dflash.selector_top_k=0"], "dflash.selector_top_k=0 must be >= 1"),
        (["dflash.selector_loss_weight=-1"], "dflash.selector_loss_weight=-1.0 must be >= 0"),
        (["+model.salm={pretrained_llm: x}"], "set exactly one of model.pretrained_name"),
        (
            ["data.train_ds.input_cfg=[{type: lhotse_as_conversation, cuts_path: c, audio_locator_tag: '<audio>'}]"],
            "data.train_ds.input_cfg[0].audio_locator_tag='<audio>' differs from model.audio_locator_tag='<|audio|>'",
        ),
    ],
)
def test_bad_config_is_rejected_with_its_message(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose("dflash", VALID + overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_input_may_name_the_targets_audio_tag_as_nemos_inputs_do():
    inputs = "[{type: lhotse_as_conversation, cuts_path: c, audio_locator_tag: '<|audio|>'}]"
    run, _ = validate_config(compose("dflash", VALID + [f"data.train_ds.input_cfg={inputs}"]))
    assert run.data.train_ds.input_cfg[0].audio_locator_tag == run.model.audio_locator_tag


INPUT = "data.train_ds.input_cfg=[{type: lhotse_as_conversation, cuts_path: c}]"


@pytest.mark.parametrize(
    "nemo_keys",
    [["model.packed_sequences=true"], ["data.train_ds.use_packed_sequence_sampling=true"],
     ["model.packed_sequences=true", "data.train_ds.use_packed_sequence_sampling=true", "data.train_ds.packing=true"]],
)
def test_nemos_packing_keys_mean_packing(nemo_keys):
    run, _ = validate_config(compose("dflash", VALID + [INPUT, *nemo_keys]))
    assert run.data.train_ds.packing is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.packed_sequences=false", "data.train_ds.packing=true"],
         "model.packed_sequences=False and data.train_ds.packing=True disagree"),
        (["data.train_ds.packing=true", "data.train_ds.batch_size=8"],
         "data.train_ds.batch_size=8 with packing: a packed row is filled to batch_tokens"),
        (["data.train_ds.use_multimodal_sampling=true", "data.train_ds.batch_tokens=null", "data.train_ds.batch_size=4"],
         "data.train_ds.use_multimodal_sampling=true needs batch_tokens"),
        (["data.train_ds.use_multimodal_sampling=false"],
         "data.train_ds.use_multimodal_sampling=false batches by sample count: set batch_size and batch_tokens=null"),
    ],
)
def test_contradicting_nemo_keys_are_one_line_errors(overrides, message):
    from dflash_train.data.validate import check_data_rules

    with pytest.raises(ConfigError) as err:
        check_data_rules(validate_config(compose("dflash", VALID + [INPUT, *overrides])).run.data)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_use_multimodal_sampling_false_with_a_sample_count_is_valid():
    overrides = ["data.train_ds.use_multimodal_sampling=false", "data.train_ds.batch_tokens=null",
                 "data.train_ds.max_tokens=null", "data.train_ds.batch_size=4"]
    run, _ = validate_config(compose("dflash", VALID + [INPUT, *overrides]))
    assert run.data.train_ds.batch_size == 4 and run.data.train_ds.batch_tokens is None


def test_missing_mandatory_values_are_named():
    with pytest.raises(ConfigError, match="mandatory config value.*model.pretrained_name, data.train_ds.input_cfg"):
        validate_config(compose("dflash"))


def test_an_override_key_is_checked_against_the_schema_before_composing():
    """``dflash-train``'s check of a plain override's key (tests/test_config_check.py runs it through the CLI)."""
    from dflash_train.config.validate import check_override_key

    for known in ("dflash.num_anchors", "dflash.selector_rank", "dflash.num_nextn_predict_layers", "trainer.devices",
                  "trainer.strategy.ep_size", "data.validation_ds.input_cfg.0.cuts_path",
                  "dflash.draft_model_config.rope_theta", "model.salm.pretrained_llm", "dflash"):
        check_override_key(known)  # any variant's key, a Lightning argument, below a dict: Hydra and the schema decide
    for key, message in [
        ("data.train_ds.input_cfg.0.cuts_pth", "unknown config key 'data.train_ds.input_cfg[0].cuts_pth'; did you mean "
         "'cuts_path'?"),
        ("trainer.strategy.ep_sise", "unknown config key 'trainer.strategy.ep_sise'; did you mean 'ep_size'?"),
        ("trainer.max_stepz", "unknown config key 'trainer.max_stepz'; did you mean 'max_steps'?"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_override_key(key)
        assert str(err.value) == message


def test_draft_model_config_passes_non_managed_keys():
    run, _ = validate_config(compose("dflash", VALID + ["+dflash.draft_model_config.rope_theta=10000"]))
    assert run.dflash.draft_model_config == {"rope_theta": 10000}


SHIPPED_YAML = {
    "demo.yaml", "dflash.yaml", "dflash_local.yaml", "data/lhotse.yaml", "dflash/dflash.yaml", "dflash/dflash2.yaml", "dflash/mtp.yaml", "dflash/eagle3.yaml",
    "exp_manager/default.yaml", "model/salm.yaml", "model/salm_automodel.yaml", "trainer/cpu.yaml",
    "trainer/default.yaml",
}


def test_every_shipped_yaml_is_composed_by_a_test():
    """The parametrised tests above compose PRIMARY_CONFIGS and GROUP_OPTIONS; a new YAML (or one in a
    deeper folder those globs miss) must be added here on purpose."""
    on_disk = {str(p.relative_to(CONF)) for p in Path(CONF).rglob("*.yaml")}
    composed = {f"{g}/{o}.yaml" for g, o in GROUP_OPTIONS} | {f"{n}.yaml" for n in PRIMARY_CONFIGS}
    assert on_disk == SHIPPED_YAML and composed == SHIPPED_YAML


def test_unknown_key_inside_an_input_entry_is_named_with_its_path():
    overrides = ["model.pretrained_name=/ckpt/salm", "data.train_ds.input_cfg=[{type: lhotse_as_conversation, cut_path: x}]"]
    with pytest.raises(ConfigError, match=r"unknown config key 'data.train_ds.input_cfg\[0\].cut_path'; did you mean 'cuts_path'\?"):
        validate_config(compose("dflash", overrides))


def test_a_wheel_install_finds_the_shipped_recipe(tmp_path):
    """`pip install dflash-train` (not editable) must still compose `dflash` and `demo`."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO_ROOT

    source, wheels, site = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    # build from the sources alone: a checkout's *.egg-info would list the YAML files by itself
    shutil.copytree(REPO_ROOT / "dflash_train", source / "dflash_train",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(wheels)],
                   check=True, cwd=tmp_path)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                   check=True, cwd=tmp_path)
    probe = ("import dflash_train; from dflash_train.config.compose import compose_config; "
             "print(dflash_train.__file__); print(compose_config('dflash').dflash.variant, "
             "compose_config('demo').name)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}).stdout.split()
    assert out == [str(site / "dflash_train" / "__init__.py"), "dflash2", "demo"]


def test_nemo_groups_flatten_with_their_sampling_probabilities_and_tags(tmp_path):
    inputs = tmp_path / "inputs.yaml"
    inputs.write_text(
        "- {type: lhotse_as_conversation, cuts_path: plain.jsonl.gz, weight: 1.0}\n"
        "- type: group\n"
        "  weight: 2.0\n"
        "  tags: {context: 'Transcribe:'}\n"
        "  input_cfg:\n"
        "    - {type: lhotse_as_conversation, cuts_path: a.jsonl.gz, weight: 1.0}\n"
        "    - {type: lhotse_as_conversation, cuts_path: b.jsonl.gz, weight: 3.0, tags: {context: 'Say:'}}\n"
    )
    run, _ = validate_config(compose("dflash", VALID + [f"data.train_ds.input_cfg={inputs}"]))
    flat = run.data.train_ds.input_cfg
    assert [(i.cuts_path, i.weight, i.tags.get("context")) for i in flat] == [
        ("plain.jsonl.gz", 1.0, None),
        ("a.jsonl.gz", 0.5, "Transcribe:"),
        ("b.jsonl.gz", 1.5, "Say:"),
    ]


def test_a_nested_group_inline_is_flattened_too():
    nested = ("[{type: group, weight: 4.0, input_cfg: [{type: group, weight: 1.0, input_cfg: "
              "[{type: lhotse_as_conversation, cuts_path: x}]}, {type: lhotse_as_conversation, cuts_path: y, weight: 3.0}]}]")
    run, _ = validate_config(compose("dflash", VALID + [f"data.train_ds.input_cfg={nested}"]))
    assert [(i.cuts_path, i.weight) for i in run.data.train_ds.input_cfg] == [("x", 1.0), ("y", 3.0)]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "data.train_ds.input_cfg='{path}' does not exist; point it at a YAML file holding the list of inputs"),
        ("type: lhotse_as_conversation\n", "data.train_ds.input_cfg='{path}' holds a dict, not a list of inputs"),
        ("- {type: group, weight: 1}\n", "data.train_ds.input_cfg[0] is a group without input_cfg"),
        ("- [unclosed\n", "data.train_ds.input_cfg='{path}' is not valid YAML"),
    ],
)
def test_a_bad_input_yaml_is_a_one_line_error_naming_it(tmp_path, content, message):
    path = tmp_path / "inputs.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        validate_config(compose("dflash", VALID + [f"data.train_ds.input_cfg={path}"]))
    assert message.format(path=path) in str(err.value) and "\n" not in str(err.value)
