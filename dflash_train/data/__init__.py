"""Speech conversation data: inputs, prompt formats, batching and packing."""

from dflash_train.data.batch import SpeechBatch

__all__ = ["SpeechBatch"]
