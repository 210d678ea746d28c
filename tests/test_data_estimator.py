"""The audio token estimator predicts the real perception's frame counts exactly (0.5 s ... 65 s)."""

from types import SimpleNamespace

import pytest
import torch

from dflash_train.data.estimator import AudioTokenEstimator, ConvLength
from dflash_train.errors import ConfigError

RATE = 16000
# Whole seconds, sample-level offsets around hop and subsampling boundaries, and long audio.
DURATIONS = [
    0.5, 0.5 + 1 / RATE, 0.5 - 1 / RATE, 0.64, 0.7, 1.0, 1.3712, 2.5, 4.99, 8.0, 12.345, 20.0, 30.01, 45.5, 65.0,
]


def _actual_frames(encode, num_samples: list[int]) -> list[int]:
    """Frame counts the target's encoder path really produces, one audio per call (no padding effects)."""
    generator = torch.Generator().manual_seed(0)
    counts = []
    for n in num_samples:
        audio = 0.1 * torch.randn(1, n, generator=generator)
        counts.append(encode(audio, torch.tensor([n]))[0].shape[0])
    return counts


def test_estimate_equals_perception_output_from_half_a_second_to_65_seconds(tiny_target, audio_estimator):
    samples = [round(d * RATE) for d in DURATIONS]
    assert [audio_estimator.frames(n) for n in samples] == _actual_frames(tiny_target.encode_audio, samples)
    # 80 ms per frame on this encoder: 65 s -> 813 positions.
    assert audio_estimator.frames_for_duration(65.0) == 813


def test_estimate_in_a_padded_batch_matches_each_row(tiny_target, audio_estimator):
    samples = [RATE // 2 + 37 * k for k in range(12)]
    audios = 0.1 * torch.randn(len(samples), max(samples), generator=torch.Generator().manual_seed(1))
    frames = tiny_target.encode_audio(audios, torch.tensor(samples))
    assert [f.shape[0] for f in frames] == [audio_estimator.frames(n) for n in samples]


@pytest.mark.parametrize("chunk_seconds", [10.0, 7.3])
def test_chunked_encoding_estimate_is_exact(tiny_target, chunk_seconds):
    from omegaconf import open_dict

    cfg = tiny_target.salm.cfg
    with open_dict(cfg):
        cfg.encoder_chunk_size_seconds = chunk_seconds
    try:
        estimator = AudioTokenEstimator.from_target(tiny_target)
        samples = [round(d * RATE) for d in (0.5, 7.3, 7.31, 10.0, 10.005, 20.0, 23.7, 65.0)]
        assert [estimator.frames(n) for n in samples] == _actual_frames(tiny_target.encode_audio, samples)
        assert len(estimator.chunk_spans(round(65.0 * RATE))) == -(-65.0 // chunk_seconds)
    finally:
        with open_dict(cfg):
            del cfg["encoder_chunk_size_seconds"]


@pytest.mark.parametrize("chunk_seconds", [None, 10.0, 7.3])
def test_the_steps_encoding_with_host_counts_equals_nemos_chunked_encoding(tiny_target, chunk_seconds):
    """The training step encodes with each audio's frame count known on the host (no read of the perception's
    lengths per audio or per chunk: a host sync each on a GPU, and a read the planner's fake tensors cannot
    answer); on a padded batch of audio shorter and longer than a chunk its frames equal NeMo's
    ``encode_audio_with_optional_chunking`` bit for bit, chunked or not."""
    from nemo.collections.speechlm2.parts.encoder_chunking import encode_audio_with_optional_chunking
    from omegaconf import open_dict

    cfg = tiny_target.salm.cfg
    with open_dict(cfg):
        cfg.encoder_chunk_size_seconds = chunk_seconds
    try:
        samples = [round(d * RATE) for d in (0.5, 7.31, 10.005, 23.7, 4.99)]
        audios = 0.1 * torch.randn(len(samples), max(samples), generator=torch.Generator().manual_seed(3))
        lens = torch.tensor(samples)
        frames = [tiny_target.frame_estimator().frames(n) for n in samples]
        ours = tiny_target.encode_audio(audios, lens, frames)
        nemos = encode_audio_with_optional_chunking(tiny_target.perception, audios, lens,
                                                    chunk_size_seconds=chunk_seconds, sampling_rate=RATE)
        assert [f.shape[0] for f in ours] == frames == [f.shape[0] for f in nemos]
        assert all(torch.equal(a, b) for a, b in zip(ours, nemos))
    finally:
        with open_dict(cfg):
            del cfg["encoder_chunk_size_seconds"]


def test_a_tail_shorter_than_two_feature_frames_folds_into_the_previous_chunk(audio_estimator):
    from dataclasses import replace

    chunked = replace(audio_estimator, chunk_samples=RATE, min_chunk_samples=320)
    assert chunked.chunk_spans(2 * RATE + 100) == [RATE, RATE + 100]
    assert chunked.chunk_spans(2 * RATE + 320) == [RATE, RATE, 320]
    assert chunked.frames(0) == 0


def test_conv_length_matches_nemo_calc_length():
    from nemo.collections.asr.parts.submodules.subsampling import calc_length

    lengths = torch.arange(0, 3000)
    for kernel, stride, padding, ceil in [(3, 2, 2, False), (3, 2, 3, False), (2, 2, 0, True), (5, 2, 4, False)]:
        ours = [ConvLength(kernel, stride, padding, ceil, 3)(int(n)) for n in lengths]
        assert ours == calc_length(lengths, padding, kernel, stride, ceil, 3).tolist()


def test_unsupported_encoder_is_a_config_error(tiny_target):
    perception = SimpleNamespace(
        preprocessor=tiny_target.salm.perception.preprocessor,
        encoder=torch.nn.LSTM(4, 4),
        modality_adapter=tiny_target.salm.perception.modality_adapter,
    )
    with pytest.raises(ConfigError, match=r"cannot predict audio token counts for the target's encoder \(LSTM\)"):
        AudioTokenEstimator.from_perception(perception, RATE)
