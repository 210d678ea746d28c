"""Frozen targets (NeMo SALM, Nemotron-H SpeechLMs) behind one router, hidden-state taps and audio splicing."""

from dflash_train.target.base import FrozenTarget, TapOutput
from dflash_train.target.load import load_target_for_run, open_speech_target
from dflash_train.target.salm import SALMTarget, TargetLoadError, load_salm, read_target_dims
from dflash_train.target.splice import PlaceholderMismatchError, SplicedBatch, splice_audio_frames
from dflash_train.target.taps import derive_target_layer_ids, record_taps

__all__ = [
    "FrozenTarget",
    "PlaceholderMismatchError",
    "SALMTarget",
    "SplicedBatch",
    "TapOutput",
    "TargetLoadError",
    "derive_target_layer_ids",
    "load_salm",
    "load_target_for_run",
    "open_speech_target",
    "read_target_dims",
    "record_taps",
    "splice_audio_frames",
]
