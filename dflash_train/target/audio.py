"""What every speech target shares: audio encoded by NeMo's perception and spliced into the LLM inputs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dflash_train.data.batch import SpeechBatch
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.errors import ConfigError
from dflash_train.target.llm import FrozenLLM
from dflash_train.target.splice import SplicedBatch, splice_audio_frames


class AudioLLM(FrozenLLM):
    """A frozen LLM behind an audio perception (encoder + projection to the LLM's width).

    A subclass provides ``perception``, ``encoder_chunk_size_seconds``, ``sampling_rate``,
    ``audio_locator_tag_id``, ``pad_id`` and the LLM (:class:`FrozenLLM`); encoding and
    splicing are the same for every such target, so training and evaluation see one rule.
    """

    perception_dtype: torch.dtype | None = None
    _frames_checked = False  # host frame counts were compared with the perception's once
    _frame_estimator = None  # (chunk size, its frame estimator): frame_estimator()'s cache

    def freeze(self) -> None:
        """Frozen (:meth:`FrozenLLM.freeze`), and the perception runs no collective of its own.

        NeMo's encoders all-reduce the longest audio of every forward across ranks
        (``sync_max_audio_length``) only to pre-size a positional buffer, a collective per encode:
        ranks that encode different numbers of times (serving validation's own records, a
        text-only batch, a rank whose records all failed) would fall out of step and hang or abort
        the job. A frozen encoder grows its buffer locally instead; its outputs are the same.
        """
        super().freeze()
        for module in self.perception.modules():
            if getattr(module, "sync_max_audio_length", False):
                module.sync_max_audio_length = False

    @property
    def audio_locator_tag(self) -> str:
        """The placeholder token text that marks where an audio's frames go."""
        raise NotImplementedError

    def default_mask_token_id(self) -> int:
        """The first embedding row past the tokenizer (as DFlash drafts for Qwen3 use); error if none is free."""
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # NeMo's wrapper holds HF's tokenizer
        if len(tokenizer) >= self.vocab_size:
            raise ConfigError(
                f"the target's embedding table ({self.vocab_size} rows) has no row past its tokenizer "
                f"({len(tokenizer)} tokens); set dflash.mask_token_id to an unused token id"
            )
        return len(tokenizer)

    def run_perception_in(self, dtype: torch.dtype) -> "AudioLLM":
        """Run the audio encoder and projection in ``dtype`` and round their output to it.

        Serving does this: vLLM's NeMo SALM model keeps the perception in bfloat16 whatever
        the LLM's dtype, and the LLM sees bfloat16-rounded audio frames. An evaluation that
        must produce serving's tokens mirrors it; training leaves the perception alone.
        """
        self.perception.to(dtype)
        self.perception_dtype = dtype
        return self

    @contextmanager
    def perception_as_served(self, dtype: torch.dtype) -> Iterator["AudioLLM"]:
        """Within the block, encode audio as serving does (:meth:`run_perception_in` ``dtype``); afterwards the
        perception holds its original tensors again, bit for bit.

        Training runs the perception in the target's own precision; a measurement of serving's
        acceptance during training (validation's serving MAL) must see serving's audio frames.
        The perception's own tensors are put back (not cast back, which would round them).
        """
        if self.perception_dtype == dtype:
            yield self
            return
        perception, saved_dtype = self.perception, self.perception_dtype
        parameters = [(param, param.data) for param in perception.parameters()]
        buffers = [(module, name, buffer) for module in perception.modules() for name, buffer in module._buffers.items()]
        self.run_perception_in(dtype)
        try:
            yield self
        finally:
            for param, data in parameters:
                param.data = data
            for module, name, buffer in buffers:
                module._buffers[name] = buffer
            self.perception_dtype = saved_dtype

    @torch.no_grad()
    def encode_audio(
        self, audios: torch.Tensor, audio_lens: torch.Tensor, frames: list[int] | None = None
    ) -> list[torch.Tensor]:
        """Perception output per audio, unpadded: a list of ``[frames_i, H]``.

        ``frames``: each audio's frame count, known on the host (the data loader's exact estimate).
        With them the padded output is cut at counts known on the host, with no read of the device's
        own lengths (NeMo's unpadding reads one per audio, or per chunk: a host stall each on a GPU, and
        a read a planner's fake tensors cannot answer); the first such batch checks the counts against
        the perception's once. Encoder chunking (``encoder_chunk_size_seconds``) splits, encodes and joins
        as NeMo's ``encode_audio_with_optional_chunking`` does, its per-chunk counts taken from the frame
        estimator. Without ``frames``, NeMo's function encodes and unpads.
        """
        from nemo.collections.speechlm2.parts.encoder_chunking import encode_audio_with_optional_chunking

        if frames is None:
            encoded = encode_audio_with_optional_chunking(
                self.perception,
                audios,
                audio_lens,
                chunk_size_seconds=self.encoder_chunk_size_seconds,
                sampling_rate=self.sampling_rate,
            )
        elif self.encoder_chunk_size_seconds is None:
            encoded = self._encode_with_counts(audios, audio_lens, [[count] for count in frames])
        else:
            encoded = self._encode_chunked_with_counts(audios, audio_lens, frames)
        if self.perception_dtype is None:
            return encoded
        return [f.to(self.perception_dtype) for f in encoded]

    def frame_estimator(self) -> AudioTokenEstimator:
        """The perception's exact frame counts (the data loader's estimator), built once per chunk size."""
        chunk = self.encoder_chunk_size_seconds
        if self._frame_estimator is None or self._frame_estimator[0] != chunk:
            self._frame_estimator = (chunk, AudioTokenEstimator.from_target(self))
        return self._frame_estimator[1]

    def _encode_with_counts(
        self, signal: torch.Tensor, signal_lens: torch.Tensor, counts: list[list[int]]
    ) -> list[torch.Tensor]:
        """One perception forward over ``signal`` (rows = chunks), then each audio's chunks cut at their host
        frame counts ``counts`` (one list per audio, one count per chunk, rows in order) and joined."""
        padded, lengths = self.perception(input_signal=signal, input_signal_length=signal_lens)
        per_row = [count for chunks in counts for count in chunks]
        if not self._frames_checked:
            measured = lengths.tolist()
            if measured != per_row:
                raise ConfigError(
                    f"the perception produced {measured} frames where the data loader estimated {per_row}: "
                    "the frame estimator does not describe this target's perception; report it with the target"
                )
            self._frames_checked = True
        encoded, row = [], 0
        for chunks in counts:
            parts = [padded[row + i, :count] for i, count in enumerate(chunks)]
            encoded.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
            row += len(chunks)
        return encoded

    def _encode_chunked_with_counts(
        self, audios: torch.Tensor, audio_lens: torch.Tensor, frames: list[int]
    ) -> list[torch.Tensor]:
        """NeMo's chunked encoding (every audio split into ``encoder_chunk_size_seconds`` spans, a short tail
        joined to the span before it, all spans through one perception forward) when some audio is longer
        than a chunk; otherwise one forward over the batch. Per-chunk frame counts come from the estimator."""
        from torch.nn.utils.rnn import pad_sequence

        estimator = self.frame_estimator()
        samples = audio_lens.tolist()  # the split needs sample counts on the host: one read per batch
        spans = [estimator.chunk_spans(count) for count in samples]
        if all(len(chunks) == 1 for chunks in spans):
            return self._encode_with_counts(audios, audio_lens, [[count] for count in frames])
        pieces, piece_lens, counts = [], [], []
        for audio, chunks, total in zip(audios, spans, frames):
            begin = 0
            for span in chunks:
                pieces.append(audio[begin:begin + span])
                piece_lens.append(span)
                begin += span
            counts.append(estimator.span_frames(chunks))
            if sum(counts[-1]) != total:
                raise ConfigError(
                    f"an audio of {begin} samples is {sum(counts[-1])} frames in {len(chunks)} chunks where the data "
                    f"loader estimated {total}: the frame estimator does not describe this target's chunking"
                )
        signal = pad_sequence(pieces, batch_first=True)
        signal_lens = torch.as_tensor(piece_lens, dtype=audio_lens.dtype, device=audio_lens.device)
        return self._encode_with_counts(signal, signal_lens, counts)

    @torch.no_grad()
    def splice_batch(self, batch: SpeechBatch, mask_token_id: int) -> SplicedBatch:
        """Embed text, run perception on the audio and splice its frames at the placeholders."""
        has_audio = len(batch.audios_per_row) and sum(batch.audios_per_row)
        audio_embeds = self.encode_audio(batch.audios, batch.audio_lens, batch.audio_frames) if has_audio else []
        row_lengths, audio_positions = batch.placements(self.audio_locator_tag_id)
        safe_ids = torch.where(batch.input_ids == self.audio_locator_tag_id, self.pad_id, batch.input_ids)
        return splice_audio_frames(
            input_ids=batch.input_ids,
            row_lengths=row_lengths,
            audio_positions=audio_positions,
            loss_mask=batch.loss_mask,
            text_embeds=self.embed_tokens(safe_ids),
            audio_embeds=audio_embeds,
            audios_per_row=batch.audios_per_row,
            mask_token_id=mask_token_id,
            pad_id=self.pad_id,
            sample_ids=batch.sample_ids,
            document_ids=batch.document_ids,
        )
