"""The conversation every input format is converted to, and how a sample is rejected.

A bad sample either raises :class:`SampleSkipped` with one of :data:`SKIP_REASONS` (the
pipeline counts it and moves on) or :class:`DataError` (the input itself is malformed:
fixing it needs a person, so training stops with a one-line message naming the sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lhotse.cut import Cut

from dflash_train.errors import OneLineError

ROLES = ("system", "user", "assistant")

# reason -> what it means; the counters are logged as data/skipped/<reason>.
SKIP_REASONS = {
    "missing_audio": "an audio file does not exist",
    "unreadable_audio": "an audio file (on disk or in a shard) exists but cannot be opened as audio",
    "after_unreadable_audio": "a tarred conversation after an undecodable file in its shard (NeMo's reader stops there)",
    "nonfinite_audio": "an audio segment holds NaN or infinite samples",
    "empty_audio": "an audio segment has zero length",
    "audio_out_of_range": "offset + duration run past the end of the audio file",
    "no_supervision": "a lhotse cut has no supervision segment (nothing to transcribe)",
    "empty_transcript": "a supervised reply is empty or whitespace",
    "no_supervised_turn": "a conversation has no assistant turn to supervise",
    "below_min_duration": "total audio is shorter than min_duration",
    "above_max_duration": "total audio is longer than max_duration",
    "too_many_tokens": "more LLM positions (text tokens + audio frames) than max_tokens / batch_tokens",
}


class SampleSkipped(Exception):
    """A sample cannot be trained on; it is dropped and counted under ``reason``."""

    def __init__(self, reason: str, detail: str):
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DataError(OneLineError, ValueError):
    """Malformed input data (bad record structure, placeholder/audio mismatch); names the sample."""


@dataclass
class Turn:
    """One turn: text, or one audio segment (a lhotse cut) that becomes one placeholder token."""

    role: str
    text: Optional[str] = None
    audio: Optional[Cut] = None
    supervised: bool = False


@dataclass
class Conversation:
    """A sample before tokenization: an id and its turns in order."""

    id: str
    turns: list[Turn]

    @property
    def audio_cuts(self) -> list[Cut]:
        """The audio segments in turn order (the order of their placeholders)."""
        return [turn.audio for turn in self.turns if turn.audio is not None]

    @property
    def duration(self) -> float:
        """Total audio duration in seconds."""
        return sum(cut.duration for cut in self.audio_cuts)
