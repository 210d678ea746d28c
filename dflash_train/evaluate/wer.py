"""Word error rate with Whisper's English normalizer (``whisper_normalizer``) and ``jiwer``'s alignment."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

NORMALIZER = "whisper_normalizer.english.EnglishTextNormalizer"


@lru_cache(maxsize=1)
def _normalizer():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


def normalize(text: str) -> str:
    """Whisper's English normalization: case, punctuation, spelling variants, numbers."""
    return _normalizer()(text)


@dataclass(frozen=True)
class WerResult:
    """Corpus WER: word errors over reference words, pooled over the scored samples."""

    wer: float
    errors: int
    reference_words: int
    substitutions: int
    deletions: int
    insertions: int
    scored: int
    unscored_ids: tuple[str, ...]  # empty reference after normalization: no WER defined

    def to_dict(self) -> dict:
        return {
            "wer": self.wer,
            "errors": self.errors,
            "reference_words": self.reference_words,
            "substitutions": self.substitutions,
            "deletions": self.deletions,
            "insertions": self.insertions,
            "scored_samples": self.scored,
            "unscored_ids": list(self.unscored_ids),
            "normalizer": NORMALIZER,
        }


def corpus_wer(ids: Sequence[str], hypotheses: Sequence[str], references: Sequence[str]) -> WerResult:
    """WER of ``hypotheses`` against ``references`` after normalization; empty references are not scored."""
    import jiwer

    refs, hyps, unscored = [], [], []
    for sample_id, hyp, ref in zip(ids, hypotheses, references, strict=True):
        ref = normalize(ref or "")
        if not ref.strip():
            unscored.append(sample_id)
            continue
        refs.append(ref)
        hyps.append(normalize(hyp))
    if not refs:
        return WerResult(float("nan"), 0, 0, 0, 0, 0, 0, tuple(unscored))
    out = jiwer.process_words(refs, hyps)
    words = out.hits + out.substitutions + out.deletions
    errors = out.substitutions + out.deletions + out.insertions
    return WerResult(
        errors / words, errors, words, out.substitutions, out.deletions, out.insertions, len(refs), tuple(unscored)
    )
