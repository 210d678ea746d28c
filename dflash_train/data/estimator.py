"""How many LLM positions an audio occupies after the target's perception, computed exactly.

Token budgets, the max-token cap and packing all need a sample's length *before* the
(expensive) perception runs. The length of an audio's frame sequence is a pure function
of its sample count: the preprocessor's hop, the encoder's subsampling convolutions and,
when the target encodes long audio in chunks, the chunk split. :class:`AudioTokenEstimator`
reads those parameters off the target's real perception modules once and evaluates the
same arithmetic in plain Python (picklable, no tensors, no model reference kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence

from dflash_train.errors import ConfigError

if TYPE_CHECKING:
    from dflash_train.target.base import FrozenTarget


@dataclass(frozen=True)
class ConvLength:
    """Output length of ``repeat`` stacked 1-D strided convolutions (or poolings) on a length."""

    kernel: int
    stride: int
    padding: int  # left + right
    ceil_mode: bool
    repeat: int

    def __call__(self, length: int) -> int:
        for _ in range(self.repeat):
            numerator = length + self.padding - self.kernel
            length = (-(-numerator // self.stride) if self.ceil_mode else numerator // self.stride) + 1
        return length


@dataclass(frozen=True)
class AudioTokenEstimator:
    """Exact perception frame count (= LLM positions) for an audio of a given length.

    Build it with :meth:`from_target` (a loaded SALM target) or :meth:`from_perception`.
    """

    sampling_rate: int
    n_fft: int
    hop_length: int
    stft_pad_amount: Optional[int]
    stages: tuple[ConvLength, ...]
    chunk_samples: Optional[int] = None
    min_chunk_samples: int = 1

    @classmethod
    def from_target(cls, target: "FrozenTarget") -> "AudioTokenEstimator":
        """Estimator for a loaded target with audio (its ``perception``, ``sampling_rate`` and
        ``encoder_chunk_size_seconds``, the members of ``FrozenTarget`` that fix frame counts)."""
        if target.perception is None:
            raise ValueError(f"{type(target).__name__} has no audio perception: it cannot estimate audio frames")
        return cls.from_perception(target.perception, int(target.sampling_rate), target.encoder_chunk_size_seconds)

    @classmethod
    def from_perception(
        cls, perception, sampling_rate: int, chunk_size_seconds: float | None = None
    ) -> "AudioTokenEstimator":
        """Read hop, FFT size, subsampling and chunking parameters off NeMo's ``AudioPerceptionModule``."""
        featurizer = perception.preprocessor.featurizer
        stages = (
            *_length_stages(perception.encoder, "encoder"),
            *_length_stages(perception.modality_adapter, "adapter"),
        )
        estimator = cls(
            sampling_rate=int(sampling_rate),
            n_fft=int(featurizer.n_fft),
            hop_length=int(featurizer.hop_length),
            stft_pad_amount=_optional_int(getattr(featurizer, "stft_pad_amount", None)),
            stages=tuple(stages),
        )
        estimator._check_feature_lengths(featurizer)
        if chunk_size_seconds is None:
            return estimator
        if chunk_size_seconds <= 0:
            raise ConfigError(f"encoder_chunk_size_seconds={chunk_size_seconds} must be positive")
        chunk = max(1, int(round(float(chunk_size_seconds) * sampling_rate)))
        minimum = estimator._min_chunk_samples()
        return replace(estimator, chunk_samples=max(chunk, minimum), min_chunk_samples=minimum)

    def feature_frames(self, num_samples: int) -> int:
        """Preprocessor (mel-spectrogram) frames for ``num_samples`` samples, as NeMo's featurizer counts them."""
        if num_samples == 0:
            return 0
        pad = 2 * self.stft_pad_amount if self.stft_pad_amount is not None else (self.n_fft // 2) * 2
        return (num_samples + pad - self.n_fft) // self.hop_length

    def _unchunked_frames(self, num_samples: int) -> int:
        length = self.feature_frames(num_samples)
        for stage in self.stages:
            length = stage(length)
        return length

    def frames(self, num_samples: int) -> int:
        """Perception output frames for an audio of ``num_samples`` samples at :attr:`sampling_rate`."""
        if num_samples <= 0:
            return 0
        return sum(self.chunk_frames(num_samples))

    def chunk_frames(self, num_samples: int) -> list[int]:
        """Perception output frames of each chunk the target encodes separately (:meth:`chunk_spans`), in order."""
        return self.span_frames(self.chunk_spans(num_samples))

    def span_frames(self, spans: list[int]) -> list[int]:
        """Perception output frames of each span of samples encoded on its own (spans from :meth:`chunk_spans`,
        for a caller that has split the audio already)."""
        return [self._unchunked_frames(span) if span > 0 else 0 for span in spans]

    def frames_for_duration(self, seconds: float) -> int:
        """Frames for an audio of ``seconds`` (sample count rounded the way lhotse rounds it)."""
        from lhotse.utils import compute_num_samples

        return self.frames(compute_num_samples(seconds, self.sampling_rate))

    def chunk_spans(self, num_samples: int) -> list[int]:
        """Sample counts of the chunks the target encodes separately (one span when chunking is off)."""
        if self.chunk_samples is None or num_samples <= self.chunk_samples:
            return [num_samples]
        spans = [min(self.chunk_samples, num_samples - begin) for begin in range(0, num_samples, self.chunk_samples)]
        if len(spans) > 1 and spans[-1] < self.min_chunk_samples:
            tail = spans.pop()
            spans[-1] += tail
        return spans

    def _min_chunk_samples(self) -> int:
        """Shortest chunk with at least two feature frames (per-feature normalisation needs two)."""
        for multiple in range(1, 17):
            if self.feature_frames(multiple * self.hop_length) >= 2:
                return multiple * self.hop_length
        return 17 * self.hop_length

    def _check_feature_lengths(self, featurizer) -> None:
        """Compare our frame arithmetic with the featurizer's own ``get_seq_len`` on a range of lengths."""
        import torch

        probe = torch.arange(1, 40 * self.hop_length + 1, 7)
        theirs = featurizer.get_seq_len(probe).tolist()
        ours = [self.feature_frames(int(n)) for n in probe]
        if ours != theirs:
            raise ConfigError(
                f"the target's audio preprocessor ({type(featurizer).__name__}) counts frames differently from "
                "the audio token estimator; token budgets would be wrong"
            )


def _optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


def _length_stages(module, where: str) -> Sequence[ConvLength]:
    """Length-changing steps of a perception encoder or modality adapter, in forward order."""
    from torch import nn

    kind = type(module).__name__
    if kind in ("IdentityConnector",):
        return []
    if kind != "ConformerEncoder":
        raise ConfigError(
            f"cannot predict audio token counts for the target's {where} ({kind}); supported: ConformerEncoder "
            "(Linear or convolutional subsampling) and IdentityConnector"
        )
    stages = []
    pre = module.pre_encode
    if not isinstance(pre, nn.Linear):
        stages.append(_conv_subsampling_length(pre, where))
    reduction = getattr(module, "reduction_subsampling", None)
    if reduction is not None:
        if reduction.reduction == "pooling":
            stages.append(
                ConvLength(reduction.kernel_size, reduction.stride, reduction.padding, False, reduction._sampling_num)
            )
        else:
            stages.append(_conv_subsampling_length(reduction.reduction_enc, where))
    return stages


def _conv_subsampling_length(pre, where: str) -> ConvLength:
    kind = type(pre).__name__
    if kind != "ConvSubsampling" or not hasattr(pre, "_kernel_size"):
        raise ConfigError(f"cannot predict audio token counts for the target's {where} subsampling ({kind})")
    return ConvLength(
        kernel=int(pre._kernel_size),
        stride=int(pre._stride),
        padding=int(pre._left_padding + pre._right_padding),
        ceil_mode=bool(pre._ceil_mode),
        repeat=int(pre._sampling_num),
    )
