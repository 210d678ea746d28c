"""Evaluation requests from the data pipeline: the prompt exactly as training renders it, plus the reply.

A record is read and converted by the same input readers and prompt format as training
(:mod:`dflash_train.data`), tokenized in one piece, and cut where its last supervised
reply begins: what is left (system prompt, context, audio placeholder, earlier turns and
the assistant header) is the generation prompt, token for token what the chat template
with ``add_generation_prompt`` produces. The cut-off reply is the reference transcript.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from dflash_train.config.schema import InputConfig
from dflash_train.data.collate import collate_padded
from dflash_train.data.conversation import Conversation, DataError, SampleSkipped
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.examples import Example, Filters, Preparer
from dflash_train.data.inputs import Input, open_input
from dflash_train.data.prompt import ChatMLFormat
from dflash_train.evaluate.decoder import Decoded, StopRule, greedy_decode
from dflash_train.evaluate.session import TargetSession
from dflash_train.target import FrozenTarget


@dataclass
class EvalRequest:
    """One request: its place in the input, the generation prompt and the reference reply."""

    index: int
    id: str
    record: Any  # as read from the input (a lhotse cut or a JSON record)
    prompt: Example  # input_ids end with the assistant header; one placeholder per audio
    reference: str


@dataclass
class RequestFailure:
    """A record that could not become a request (missing audio, malformed record, ...)."""

    index: int
    id: str
    error: str


def record_id(inp: InputConfig, record: Any) -> str:
    """The sample id of a raw record, without converting it (the ids :mod:`dflash_train.data.inputs` gives).

    Cuts keep their id; NeMo ASR manifest lines are ``<file name>:<line>``; conversation
    records use their ``id`` or, without one, ``<file name>:<line>``.
    """
    if hasattr(record, "data"):
        fallback = f"{Path(record.path).name}:{record.line}"
        if inp.type == "multimodal_conversation":
            return str(record.data.get("id", fallback))
        return fallback
    return str(record.id)


def generation_prompt(example: Example) -> Example:
    """``example`` cut where its last supervised reply starts: the prompt the target answers."""
    supervised = np.flatnonzero(example.loss_mask)
    if supervised.size == 0:
        raise DataError(f"sample '{example.id}' has no supervised reply to cut the prompt at")
    start = int(supervised[-1])
    while start > 0 and example.loss_mask[start - 1]:
        start -= 1
    ids = example.input_ids[:start]
    return replace(
        example,
        input_ids=ids,
        loss_mask=np.zeros(len(ids), dtype=bool),
        num_tokens=len(ids) - len(example.audio) + sum(example.audio_frames),
        num_supervised=0,
    )


def last_reply(conversation: Conversation) -> str:
    """The text of the conversation's last supervised turn."""
    return [turn for turn in conversation.turns if turn.supervised][-1].text


def selected_records(
    inp: InputConfig,
    source: Input,
    limit: Optional[int] = None,
    indices: Optional[set[int]] = None,
    sample_ids: Optional[set[str]] = None,
) -> Iterator[tuple[int, str, Any]]:
    """``(index, sample id, record)`` for the selected records of ``source``, in file order: the first
    ``limit`` records, of those only ``indices`` / ``sample_ids`` when given (the selection every
    evaluation shares, so a re-run of failed ids reaches the same records)."""
    for index, record in enumerate(source.records):
        if limit is not None and index >= limit:
            return
        rid = record_id(inp, record)
        if (indices is not None and index not in indices) or (sample_ids is not None and rid not in sample_ids):
            continue
        yield index, rid, record


def read_requests(
    inp: InputConfig,
    prompt_format: ChatMLFormat,
    estimator: AudioTokenEstimator,
    system_prompt: Optional[str] = None,
    limit: Optional[int] = None,
    indices: Optional[set[int]] = None,
    sample_ids: Optional[set[str]] = None,
    source: Optional[Input] = None,
) -> Iterator[EvalRequest | RequestFailure]:
    """Requests of ``inp`` in file order, each or its failure.

    ``limit`` keeps the first N records, ``indices`` / ``sample_ids`` only the named ones.
    ``source`` replaces the opened input (a caller that rewrote records before conversion).
    """
    source = source or open_input(inp, system_prompt, estimator.sampling_rate)
    prepare = Preparer(prompt_format, estimator, Filters())
    for index, rid, record in selected_records(inp, source, limit, indices, sample_ids):
        try:
            conversation = source.convert(record)
            prompt = generation_prompt(prepare(conversation))
        except (SampleSkipped, DataError) as err:
            yield RequestFailure(index, rid, f"{type(err).__name__}: {err}")
            continue
        yield EvalRequest(index, conversation.id, record, prompt, last_reply(conversation))


@torch.no_grad()
def prompt_inputs(target: FrozenTarget, prompt: Example) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's LLM inputs ``[1, S, H]`` (audio loaded, encoded and spliced as in training) and its token
    ids ``[S]`` as vLLM holds them: the audio placeholder at every audio frame."""
    placeholder = target.audio_locator_tag_id
    batch = collate_padded([prompt], target.pad_id, "eval").with_placements(placeholder)
    spliced = target.splice_batch(batch.to(target.embed_tokens.weight.device), placeholder)
    return spliced.inputs_embeds.to(target.embed_tokens.weight.dtype), spliced.input_ids[0]


def prompt_embeddings(target: FrozenTarget, prompt: Example) -> torch.Tensor:
    """The prompt's LLM inputs ``[1, S, H]``: audio loaded, encoded and spliced as in training."""
    return prompt_inputs(target, prompt)[0]


def reply_text(prompt_format: ChatMLFormat, decoded: Decoded) -> str:
    """The reply as text: the tokens before the stop token that ended it, special tokens dropped."""
    ids = decoded.token_ids[:-1] if decoded.finish_reason == "stop" else decoded.token_ids
    return prompt_format.tokenizer.decode(ids, skip_special_tokens=True)


def greedy_reply(target: FrozenTarget, prompt_format: ChatMLFormat, embeds: torch.Tensor, rule: StopRule) -> tuple[Decoded, str]:
    """The target's greedy reply to one prompt (its spliced embeddings), as tokens and as text.

    The one decode-to-text path: ``dflash-eval``'s target-only pass, ``dflash-labels`` and the
    reference target's transcripts all read the target's reply through it.
    """
    decoded = greedy_decode(TargetSession(target, rolls_back=False), embeds, rule)
    return decoded, reply_text(prompt_format, decoded)
