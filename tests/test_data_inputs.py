"""Each input format round-trips to SpeechBatches on real audio; every bad input is counted or named."""

import json
import logging
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import UTTERANCES
from lhotse import CutSet, Recording, SupervisionSegment

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.conversation import DataError
from dflash_train.data.module import SpeechDataModule
from dflash_train.data.validate import validate_data_config
from dflash_train.errors import ConfigError

TAG = "<|audio|>"
RATE = 16000


@pytest.fixture()
def wavs(speech_files, tmp_path):
    """The session's spoken utterances copied next to the manifests written by each test."""
    out = {}
    for uid, path in speech_files.items():
        out[uid] = tmp_path / f"{uid}.wav"
        shutil.copy(path, out[uid])
    return out


def _module(target, estimator, inputs, system_prompt=None, **split):
    split = {"batch_size": 8, **split}
    cfg = DataConfig(
        system_prompt=system_prompt,
        train_ds=DatasetConfig(input_cfg=inputs, **split),
        validation_ds=DatasetConfig(input_cfg=inputs, **split),
    )
    return SpeechDataModule(cfg, target.tokenizer, TAG, estimator, seed=7, rank=0, world_size=1)


def _read_all(module):
    """Every validation batch of every set, in order."""
    return [batch for loader in module.val_dataloader() for batch in loader]


def _rows(target, batch):
    hf = target.tokenizer.tokenizer
    for i in range(batch.input_ids.shape[0]):
        n = int(batch.lengths[i])
        ids, mask = batch.input_ids[i, :n], batch.loss_mask[i, :n]
        yield hf.decode(ids), hf.decode(ids[mask])


def _nemo(manifest):
    return InputConfig(type="lhotse_as_conversation", manifest_filepath=manifest)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_lhotse_cuts_keep_offsets_and_context(tiny_target, audio_estimator, wavs, tmp_path):
    recording = Recording.from_file(str(wavs["utt-long"]), recording_id="long")
    segment = recording.to_cut().truncate(offset=0.25, duration=1.5)
    segment.supervisions = [SupervisionSegment("s1", "long", start=0.0, duration=1.5, text="a small speech model")]
    segment.custom = {"context": "Transcribe:"}
    whole = Recording.from_file(str(wavs["utt-short"]), recording_id="short").to_cut()
    whole.supervisions = [SupervisionSegment("s2", "short", 0.0, whole.duration, text=UTTERANCES["utt-short"])]
    cuts_path = tmp_path / "cuts.jsonl.gz"
    CutSet([segment.with_id("seg"), whole.with_id("whole")]).to_file(cuts_path)
    module = _module(
        tiny_target, audio_estimator,
        [InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts_path), tags={"context": "Default prompt."})],
        system_prompt="Be brief.",
    )
    (batch,) = _read_all(module)
    assert batch.sample_ids == ["seg", "whole"] and batch.audios_per_row == [1, 1] and batch.dataset_name == "cuts"
    rows = list(_rows(tiny_target, batch))
    assert rows[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTranscribe: <|audio|><|im_end|>\n"
        "<|im_start|>assistant\na small speech model<|im_end|>\n",
        "a small speech model<|im_end|>",
    )
    assert "user\nDefault prompt. <|audio|>" in rows[1][0]  # the input's tag is the default context
    # The audio is exactly the cut's segment of the file, at the target's rate.
    samples, rate = sf.read(str(wavs["utt-long"]), dtype="float32")
    expected = samples[int(0.25 * RATE) : int(0.25 * RATE) + int(1.5 * RATE)]
    assert rate == RATE and batch.audio_lens.tolist() == [len(expected), whole.num_samples]
    torch.testing.assert_close(batch.audios[0, : len(expected)], torch.from_numpy(expected))
    assert not batch.audios[1, whole.num_samples :].any()


def test_nemo_manifest_resolves_relative_paths_and_offsets(tiny_target, audio_estimator, wavs, tmp_path):
    manifest = _write_jsonl(tmp_path / "asr_manifest.json", [
        {"audio_filepath": "utt-mid.wav", "duration": 1.0, "offset": 0.5, "text": "the draft proposes tokens"},
        {"audio_filepath": str(wavs["utt-short"]), "duration": 0.8, "text": "hello world", "context": "Repeat:"},
    ])
    module = _module(tiny_target, audio_estimator, [_nemo(manifest)])
    (batch,) = _read_all(module)
    assert batch.sample_ids == ["asr_manifest.json:1", "asr_manifest.json:2"]
    assert batch.audio_lens.tolist() == [RATE, int(0.8 * RATE)]
    samples, _ = sf.read(str(wavs["utt-mid"]), dtype="float32")
    torch.testing.assert_close(batch.audios[0], torch.from_numpy(samples[RATE // 2 : RATE // 2 + RATE]))
    (first, supervised_first), (second, supervised_second) = _rows(tiny_target, batch)
    assert "user\n<|audio|><|im_end|>" in first and supervised_first == "the draft proposes tokens<|im_end|>"
    assert "user\nRepeat: <|audio|><|im_end|>" in second and supervised_second == "hello world<|im_end|>"


@pytest.mark.parametrize("assistant_turns, supervised", [
    ("all", "It says hello.<|im_end|>It says the draft proposes.<|im_end|>"),
    ("last", "It says the draft proposes.<|im_end|>"),
])
def test_multi_turn_conversations_supervise_the_chosen_turns(tiny_target, audio_estimator, wavs, tmp_path,
                                                             assistant_turns, supervised):
    manifest = _write_jsonl(tmp_path / "chats.jsonl", [{
        "id": "chat-1",
        "conversations": [
            {"from": "User", "type": "audio", "value": "utt-short.wav", "duration": 0.9},
            {"from": "Assistant", "type": "text", "value": "It says hello."},
            {"from": "User", "type": "text", "value": "And this one?"},
            {"from": "User", "type": "audio", "value": "utt-mid.wav", "offset": 0.1, "duration": 1.2},
            {"from": "Assistant", "type": "text", "value": "It says the draft proposes."},
            {"from": "User", "type": "text", "value": "Thanks."},
        ],
    }])
    module = _module(tiny_target, audio_estimator, [
        InputConfig(type="multimodal_conversation", manifest_filepath=manifest, assistant_turns=assistant_turns,
                    tags={"system_prompt": "You transcribe."}),
    ])
    (batch,) = _read_all(module)
    ((text, got),) = _rows(tiny_target, batch)
    assert got == supervised
    assert batch.audios_per_row == [2] and batch.audio_lens.tolist() == [int(0.9 * RATE), int(1.2 * RATE)]
    assert text.startswith("<|im_start|>system\nYou transcribe.<|im_end|>\n<|im_start|>user\n<|audio|><|im_end|>")
    assert "user\nAnd this one? <|audio|><|im_end|>" in text
    assert "Thanks." not in text  # turns after the last supervised reply are dropped


def test_every_bad_sample_is_skipped_with_its_reason_and_logged(tiny_target, audio_estimator, wavs, tmp_path, caplog):
    (tmp_path / "garbage.wav").write_bytes(b"this is not audio at all" * 10)
    sf.write(str(tmp_path / "empty.wav"), np.zeros(0, dtype=np.float32), RATE)
    manifest = _write_jsonl(tmp_path / "bad.json", [
        {"audio_filepath": "utt-short.wav", "duration": 0.5, "text": "kept"},
        {"audio_filepath": "nowhere.wav", "duration": 1.0, "text": "x"},
        {"audio_filepath": "garbage.wav", "duration": 1.0, "text": "x"},
        {"audio_filepath": "empty.wav", "duration": 0.0, "text": "x"},
        {"audio_filepath": "utt-short.wav", "duration": 5.0, "offset": 0.5, "text": "x"},
        {"audio_filepath": "utt-short.wav", "duration": 0.5, "text": "   "},
        {"audio_filepath": "utt-short.wav", "duration": 0.05, "text": "too short"},
        {"audio_filepath": "utt-long.wav", "duration": 3.0, "text": "too long in seconds"},
        {"audio_filepath": "utt-short.wav", "duration": 0.5, "text": "many tokens " * 30},
    ])
    unsupervised = Recording.from_file(str(wavs["utt-short"]), recording_id="u").to_cut().with_id("no-sup")
    vanishing = tmp_path / "vanishing.wav"
    shutil.copy(wavs["utt-short"], vanishing)
    gone = Recording.from_file(str(vanishing), recording_id="v").to_cut().with_id("gone")
    gone.supervisions = [SupervisionSegment("g", "v", 0.0, gone.duration, text="x")]
    cuts_path = tmp_path / "bad_cuts.jsonl.gz"
    CutSet([unsupervised, gone]).to_file(cuts_path)
    vanishing.unlink()  # the manifest outlives its audio
    chats = _write_jsonl(tmp_path / "chats.jsonl", [
        {"id": "only-user", "conversations": [{"from": "User", "type": "text", "value": "hi"}]},
    ])
    caplog.set_level(logging.WARNING, logger="dflash_train.data.examples")
    module = _module(
        tiny_target, audio_estimator,
        [
            InputConfig(type="lhotse_as_conversation", manifest_filepath=manifest, name="bad"),
            InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts_path), name="bad"),
            InputConfig(type="multimodal_conversation", manifest_filepath=chats, name="bad"),
        ],
        min_duration=0.1, max_duration=2.5, max_tokens=100,
    )
    (batch,) = _read_all(module)
    assert batch.sample_ids == ["bad.json:1"]
    expected = {
        "missing_audio": 2, "unreadable_audio": 1, "empty_audio": 1, "audio_out_of_range": 1, "empty_transcript": 1,
        "below_min_duration": 1, "above_max_duration": 1, "too_many_tokens": 1, "no_supervision": 1,
        "no_supervised_turn": 1,
    }
    assert module.skip_counts() == dict(sorted(expected.items()))
    _read_all(module)  # a second validation run re-reads the set but counts nothing twice
    assert module.skip_counts() == dict(sorted(expected.items()))
    logged = caplog.text
    assert "skipped a sample (missing_audio): sample 'bad.json:2'" in logged and "nowhere.wav does not exist" in logged
    assert "skipped a sample (audio_out_of_range): sample 'bad.json:5': segment ends at 5.500s" in logged


def test_malformed_records_and_placeholder_mismatch_are_errors_naming_the_sample(
    tiny_target, audio_estimator, wavs, tmp_path
):
    cases = [
        ("not_json.json", "{not json}\n", r"not_json.json:1: not valid JSON"),
        ("no_text.json", json.dumps({"audio_filepath": "utt-short.wav", "duration": 0.5}) + "\n",
         r"no_text.json:1: record has no 'text' key"),
        ("tag_in_text.json",
         json.dumps({"audio_filepath": "utt-short.wav", "duration": 0.5, "text": "hi", "context": f"x {TAG}"}) + "\n",
         r"sample 'tag_in_text.json:1' has 2 audio placeholder\(s\)"),
    ]
    for name, body, message in cases:
        (tmp_path / name).write_text(body)
        module = _module(
            tiny_target, audio_estimator,
            [InputConfig(type="lhotse_as_conversation", manifest_filepath=str(tmp_path / name))],
        )
        with pytest.raises(DataError, match=message):
            _read_all(module)
    chats = _write_jsonl(tmp_path / "roles.jsonl", [
        {"id": "c", "conversations": [{"from": "Robot", "type": "text", "value": "hi"}]},
    ])
    module = _module(tiny_target, audio_estimator, [InputConfig(type="multimodal_conversation",
                                                               manifest_filepath=chats)])
    with pytest.raises(DataError, match=r"roles.jsonl:1: turn 0: unknown role from='Robot'"):
        _read_all(module)


def test_audio_that_fails_to_load_after_the_checks_stops_with_the_sample_named(tiny_target, audio_estimator, wavs,
                                                                               tmp_path):
    from dflash_train.data.collate import collate_padded

    manifest = _write_jsonl(tmp_path / "late.json", [{"audio_filepath": "utt-mid.wav", "duration": 1.0, "text": "x"}])
    module = _module(tiny_target, audio_estimator, [_nemo(manifest)])
    (example,) = list(module.validation_examples("late"))
    wavs["utt-mid"].unlink()  # gone between sampling (main process) and loading (worker)
    with pytest.raises(DataError, match=r"sample 'late.json:1': cannot load audio"):
        collate_padded([example], tiny_target.pad_id, "late")


def test_training_with_no_usable_sample_fails_with_the_skip_reasons(tiny_target, audio_estimator, tmp_path):
    manifest = _write_jsonl(tmp_path / "all_bad.json", [{"audio_filepath": "gone.wav", "duration": 1.0, "text": "x"}])
    module = _module(tiny_target, audio_estimator, [_nemo(manifest)])
    message = r"data.train_ds has no usable sample for rank 0 of 1 in .*all_bad.json; skipped: \{'missing_audio': 1\}"
    with pytest.raises(DataError, match=message):
        module.train_dataloader()


def test_a_missing_dataset_path_fails_at_start_up_naming_it(tmp_path):
    cfg = DataConfig(
        train_ds=DatasetConfig(
            input_cfg=[InputConfig(type="lhotse_as_conversation", cuts_path=str(tmp_path / "nope.jsonl.gz"))],
            batch_tokens=512,
        )
    )
    with pytest.raises(ConfigError) as err:
        validate_data_config(cfg)
    assert str(err.value) == f"data.train_ds.input_cfg[0].cuts_path='{tmp_path / 'nope.jsonl.gz'}' does not exist"


def _float_wav(path, samples, rate=RATE):
    sf.write(str(path), np.asarray(samples, dtype=np.float32), rate, subtype="FLOAT")
    return path


def test_non_finite_audio_is_skipped_and_counted_but_silence_and_clipping_are_data(tiny_target, audio_estimator,
                                                                                   wavs, tmp_path):
    speech, _ = sf.read(str(wavs["utt-short"]), dtype="float32")
    with_nan, with_inf = speech.copy(), speech.copy()
    with_nan[100:103] = np.nan
    with_inf[7] = -np.inf
    _float_wav(tmp_path / "nan.wav", with_nan)
    _float_wav(tmp_path / "inf.wav", with_inf)
    _float_wav(tmp_path / "silent.wav", np.zeros_like(speech))
    _float_wav(tmp_path / "clipped.wav", np.clip(speech * 50, -1.0, 1.0))
    seconds = len(speech) / RATE
    manifest = _write_jsonl(tmp_path / "m.json", [
        {"audio_filepath": name, "duration": seconds, "text": name}
        for name in ("nan.wav", "silent.wav", "inf.wav", "clipped.wav")
    ])
    nan_cut = Recording.from_file(str(tmp_path / "nan.wav"), recording_id="n").to_cut().with_id("nan-cut")
    nan_cut.supervisions = [SupervisionSegment("s", "n", 0.0, nan_cut.duration, text="x")]
    cuts_path = tmp_path / "nan_cuts.jsonl.gz"
    CutSet([nan_cut]).to_file(cuts_path)
    module = _module(tiny_target, audio_estimator, [
        InputConfig(type="lhotse_as_conversation", manifest_filepath=manifest, name="m"),
        InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts_path), name="m"),
    ])
    (batch,) = _read_all(module)
    assert batch.sample_ids == ["m.json:2", "m.json:4"]  # silent and clipped
    assert torch.isfinite(batch.audios).all() and float(batch.audios[0].abs().max()) == 0.0
    assert module.skip_counts() == {"nonfinite_audio": 3}


def test_stereo_audio_at_another_rate_is_resampled_with_lhotse_and_averaged(tiny_target, audio_estimator, wavs,
                                                                           tmp_path):
    speech, rate = sf.read(str(wavs["utt-mid"]), dtype="float32")
    assert rate == RATE
    low = Recording.from_file(str(wavs["utt-mid"])).resample(8000).load_audio()[0]
    stereo = np.stack([low, 0.25 * low[::-1]], axis=1)  # two different channels at 8 kHz
    sf.write(str(tmp_path / "stereo8k.wav"), stereo, 8000, subtype="PCM_16")
    manifest = _write_jsonl(tmp_path / "s.json", [
        {"audio_filepath": "stereo8k.wav", "duration": len(low) / 8000, "text": "stereo"},
    ])
    (batch,) = _read_all(_module(tiny_target, audio_estimator, [_nemo(manifest)]))
    on_disk, _ = sf.read(str(tmp_path / "stereo8k.wav"), dtype="float32")  # the 16-bit values actually stored
    expected = Recording.from_file(str(tmp_path / "stereo8k.wav")).resample(RATE).load_audio().mean(axis=0)
    assert on_disk.shape[1] == 2 and int(batch.audio_lens[0]) == len(expected) == round(len(low) * 2)
    np.testing.assert_allclose(batch.audios[0, : len(expected)].numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, body, message", [
    ("cuts.jsonl", b"{this is not json\n", r"cuts.jsonl:1: not valid JSON"),
    ("cuts.jsonl", b'{"id": "no-type"}\n', r"cuts.jsonl:1: not a lhotse cut"),
    ("cuts.jsonl.gz", b'{"id": "plain text, not gzip"}\n', r"cuts.jsonl.gz:1: cannot be read as gzipped UTF-8 JSONL"),
    ("cuts.jsonl", b"\xff\xfe\x00binary", r"cuts.jsonl:1: cannot be read as UTF-8 JSONL"),
])
def test_a_cuts_file_that_is_not_a_lhotse_jsonl_is_an_error_naming_file_and_line(tiny_target, audio_estimator,
                                                                                 tmp_path, name, body, message):
    (tmp_path / name).write_bytes(body)
    module = _module(tiny_target, audio_estimator,
                     [InputConfig(type="lhotse_as_conversation", cuts_path=str(tmp_path / name))])
    with pytest.raises(DataError, match=message) as err:
        _read_all(module)
    assert "\n" not in str(err.value)
