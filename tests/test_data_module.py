"""The datamodule under Lightning, named validation sets, shipped data configs and the demo data script."""

import hashlib
import subprocess
import sys
from itertools import islice

import lightning as L
import pytest
import soundfile as sf
import torch
from conftest import REPO_ROOT, compose
from lhotse import CutSet
from omegaconf import OmegaConf

from dflash_train.config import validate_config
from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.module import SpeechDataModule
from dflash_train.data.validate import check_data_rules, validate_data_config
from dflash_train.errors import ConfigError
from dflash_train.testing.demo_data import demo_sentences, is_demo_set, varied_sentences, write_demo_data

TAG = "<|audio|>"


class Recorder(L.LightningModule):
    """Consumes SpeechBatches like the training module does and remembers what it saw."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(("train", batch.dataset_name, len(batch.sample_ids)))
        return (self.weight * batch.input_ids.float().mean()).sum()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("val", batch.dataset_name, dataloader_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_fit_reads_training_and_every_named_validation_set(tiny_target, audio_estimator, demo_data, tmp_path):
    train, val = demo_data
    cuts = list(CutSet.from_file(val))
    CutSet(cuts[:2]).to_file(tmp_path / "clean.jsonl.gz")
    CutSet(cuts[2:]).to_file(tmp_path / "noisy.jsonl.gz")
    split = dict(batch_tokens=300, max_tokens=150, bucket_buffer_size=40, shuffle_buffer_size=40, num_workers=1)
    cfg = DataConfig(
        train_ds=DatasetConfig(input_cfg=[InputConfig(type="lhotse_as_conversation", cuts_path=str(train))], **split),
        validation_ds=DatasetConfig(
            input_cfg=[
                InputConfig(type="lhotse_as_conversation", cuts_path=str(tmp_path / "clean.jsonl.gz"), name="clean"),
                InputConfig(type="lhotse_as_conversation", cuts_path=str(tmp_path / "noisy.jsonl.gz")),
            ],
            **split,
        ),
    )
    module = SpeechDataModule(cfg, tiny_target.tokenizer, TAG, audio_estimator, seed=0)
    assert (module.rank, module.world_size) == (0, 1) and module.val_names == ["clean", "noisy"]
    recorder = Recorder()
    trainer = L.Trainer(
        max_steps=4, val_check_interval=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    trainer.fit(recorder, datamodule=module)
    train_steps = [s for s in recorder.seen if s[0] == "train"]
    assert len(train_steps) == 4 and all(name == "train" and rows >= 1 for _, name, rows in train_steps)
    val_steps = [s for s in recorder.seen if s[0] == "val"]
    assert sorted(set(val_steps)) == [("val", "clean", 0), ("val", "noisy", 1)]
    assert module.skip_counts() == {}


def test_rank_and_world_size_default_to_the_process_group(tiny_target, audio_estimator, demo_data, tmp_path,
                                                          monkeypatch):
    """Without a trainer the module asks the default process group. A real one-process group, whose answers
    are then moved to rank 1 of 3 (what a third of a launch would say): a module that assumed (0, 1)
    fails."""
    import torch.distributed as dist

    cfg = DataConfig(train_ds=DatasetConfig(input_cfg=[InputConfig(type="lhotse_as_conversation",
                                                                   cuts_path=str(demo_data[0]))], batch_size=2))
    assert (SpeechDataModule(cfg, tiny_target.tokenizer, TAG, audio_estimator, seed=0).rank, 0) == (0, 0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
        module = SpeechDataModule(cfg, tiny_target.tokenizer, TAG, audio_estimator, seed=0)
        assert (module.rank, module.world_size) == (1, 3)
        explicit = SpeechDataModule(cfg, tiny_target.tokenizer, TAG, audio_estimator, seed=0, rank=0, world_size=2)
        assert (explicit.rank, explicit.world_size) == (0, 2)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["dflash", "dflash_local", "demo"])
def test_shipped_data_sections_pass_the_data_rules(name):
    overrides = ["model.pretrained_name=/x", "data.train_ds.input_cfg=[{type: lhotse_as_conversation, cuts_path: a}]"]
    run, _ = validate_config(compose(name, overrides if name == "dflash" else []))
    check_data_rules(run.data)


def test_demo_config_validates_against_generated_data_and_names_a_missing_path(demo_data):
    train, val = demo_data
    cfg = compose("demo", [f"data.train_ds.input_cfg.0.cuts_path={train}",
                           f"data.validation_ds.input_cfg.0.cuts_path={val}"])
    run, _ = validate_config(cfg)
    validate_data_config(run.data)
    assert [i.name for i in run.data.validation_ds.input_cfg] == ["demo_val"]
    run.data.validation_ds.input_cfg[0].cuts_path = "/no/such/val.jsonl.gz"
    message = r"^data.validation_ds.input_cfg\[0\].cuts_path='/no/such/val.jsonl.gz' does not exist$"
    with pytest.raises(ConfigError, match=message):
        validate_data_config(run.data)


@pytest.mark.parametrize("change, message", [
    ({"batch_tokens": None}, "data.train_ds: set batch_tokens (token budget) or batch_size"),
    ({"packing": True, "batch_tokens": None}, "data.train_ds.packing=true needs batch_tokens"),
    ({"packing": True, "measure_total_length": False}, "packing=true needs measure_total_length=true"),
    ({"max_tokens": 5000}, "data.train_ds.max_tokens=5000 exceeds batch_tokens=4096"),
    ({"min_duration": 3.0, "max_duration": 1.0}, "data.train_ds.min_duration=3.0 is above max_duration=1.0"),
    ({"bucket_bins": [300, 100]}, "data.train_ds.bucket_bins=[300, 100] must be distinct ascending"),
    ({"input_cfg": []}, "data.train_ds.input_cfg is empty"),
    ({"input_cfg": [{"type": "lhotse_cuts"}]}, "data.train_ds.input_cfg[0].type='lhotse_cuts' is unknown"),
    ({"input_cfg": [{"type": "lhotse_as_conversation", "cuts_path": "a", "manifest_filepath": "b"}]},
     "type lhotse_as_conversation reads cuts_path (lhotse cuts) or shar_path (a lhotse Shar directory) or "
     "manifest_filepath (NeMo manifest) or manifest_filepath + tarred_audio_filepaths (NeMo tarred audio) "
     "(exactly one path key)"),
    ({"input_cfg": [{"type": "multimodal_conversation", "cuts_path": "a"}]},
     "type multimodal_conversation reads manifest_filepath (conversation JSONL)"),
    ({"input_cfg": [{"type": "lhotse_shar", "cuts_path": "a"}]}, "type lhotse_shar reads shar_path"),
    ({"input_cfg": [{"type": "nemo_tarred", "manifest_filepath": "a"}]},
     "type nemo_tarred reads manifest_filepath + tarred_audio_filepaths"),
    ({"input_cfg": [{"type": "lhotse", "cuts_path": "a", "tarred_audio_filepaths": "t"}]},
     "data.train_ds.input_cfg[0].tarred_audio_filepaths goes with manifest_filepath"),
    ({"input_cfg": [{"type": "lhotse_as_conversation", "cuts_path": "a", "weight": 0}]}, "weight=0.0 must be > 0"),
    ({"input_cfg": [{"type": "lhotse_as_conversation", "cuts_path": "a", "tags": {"prompt": "x"}}]},
     "data.train_ds.input_cfg[0].tags.prompt is unknown"),
    ({"input_cfg": [{"type": "lhotse_as_conversation", "cuts_path": "a", "assistant_turns": "last"}]},
     "assistant_turns applies to type multimodal_conversation only"),
])
def test_bad_data_values_are_one_line_config_errors(change, message):
    cfg = compose("dflash", ["model.pretrained_name=/x"])
    data = OmegaConf.to_container(cfg.data)
    data["train_ds"].update({"input_cfg": [{"type": "lhotse_as_conversation", "cuts_path": "a"}], **change})
    cfg.data = data
    with pytest.raises(ConfigError) as err:
        check_data_rules(validate_config(cfg).run.data)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_prompt_format_is_rejected():
    cfg = DataConfig(prompt_format="chatml", train_ds=DatasetConfig(
        input_cfg=[InputConfig(type="lhotse_as_conversation", cuts_path="a")], batch_size=1))
    message = r"data.prompt_format='chatml' is unknown; choose one of \['nemotron_nano_v3', 'qwen'\]"
    with pytest.raises(ConfigError, match=message):
        check_data_rules(cfg)


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_demo_data_script_is_deterministic_real_16khz_speech(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train.testing.demo_data", "--out", str(out), "--count", "5", "--val-count", "1",
         "--jobs", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "4 training cuts" in proc.stdout and "1 in" in proc.stdout
    first = _digest(out)
    write_demo_data(out, count=5, val_count=1, jobs=1, sentences=varied_sentences(5))
    assert _digest(out) == first and len(first) == 7  # 5 wavs + 2 manifests, byte for byte
    train = list(CutSet.from_file(out / "train_cuts.jsonl.gz"))
    (val,) = CutSet.from_file(out / "val_cuts.jsonl.gz")
    assert [c.supervisions[0].text for c in [val, *train]] == varied_sentences(5)
    for cut in train:
        info = sf.info(cut.recording.sources[0].source)
        assert info.samplerate == 16000 and info.channels == 1 and 1.0 < cut.duration < 6.0
    assert len({c.recording.num_samples for c in train}) == 4


def test_make_demo_recognizes_its_own_speech_set_and_not_an_earlier_one(tmp_path):
    from dflash_train.testing.demo_data import DEMO_COUNT, DEMO_VAL_COUNT, _write_jsonl_gz

    def validation_texts(texts):
        _write_jsonl_gz(tmp_path / "val_cuts.jsonl.gz", [{"supervisions": [{"text": t}]} for t in texts])

    stride = DEMO_COUNT // DEMO_VAL_COUNT
    validation_texts([varied_sentences(DEMO_COUNT)[i] for i in range(0, stride * DEMO_VAL_COUNT, stride)])
    assert is_demo_set(tmp_path)
    validation_texts([demo_sentences(320)[i] for i in range(0, 320, 10)])  # the split before this one
    assert not is_demo_set(tmp_path)
    assert not is_demo_set(tmp_path / "missing")


def test_demo_sentences_are_distinct_and_bounded():
    sentences = demo_sentences(400)
    assert len(set(sentences)) == 400 and all(s[0].isupper() and s.endswith(".") for s in sentences)
    with pytest.raises(ValueError, match="at most 400 distinct demo sentences"):
        demo_sentences(401)


def test_an_input_yaml_with_a_group_reaches_the_data_checks_and_the_stream(demo_data, tmp_path, tiny_target,
                                                                            audio_estimator):
    """NeMo's ``input_cfg: inputs.yaml`` with a group, through validation and into a real training stream."""
    from dflash_train.data.module import SpeechDataModule

    train, val = demo_data
    inputs = tmp_path / "inputs.yaml"
    inputs.write_text(f"- type: group\n  weight: 1.0\n  input_cfg:\n"
                      f"    - {{type: lhotse_as_conversation, cuts_path: {train}, weight: 3.0}}\n"
                      f"    - {{type: lhotse_as_conversation, cuts_path: {val}, weight: 1.0}}\n")
    cfg = compose("demo", [f"data.train_ds.input_cfg={inputs}", f"data.validation_ds.input_cfg.0.cuts_path={val}"])
    run, _ = validate_config(cfg)
    validate_data_config(run.data)
    assert [(i.cuts_path, i.weight) for i in run.data.train_ds.input_cfg] == [(str(train), 0.75), (str(val), 0.25)]
    from lhotse import CutSet

    module = SpeechDataModule(run.data, tiny_target.tokenizer, TAG, audio_estimator, seed=0)
    val_ids = {cut.id for cut in CutSet.from_file(val)}
    ids = [ex.id for ex in islice(iter(module.train_examples()), 80)]
    from_val = sum(i in val_ids for i in ids)
    assert 0 < from_val < len(ids) - from_val, f"{from_val} of {len(ids)} from the 0.25-weight input"
