"""Prompt formats: a conversation rendered as the target's chat template, tokenized with a loss mask.

The rendered string is tokenized in one piece (as vLLM tokenizes a chat prompt), and the
loss mask marks tokens that start inside a supervised reply: the reply's content and its
end-of-turn token, nothing of the turn header or of an unsupervised prefix such as
Nemotron's empty ``<think></think>``. Consecutive user (or system) turns are joined with a
space into one message, as NeMo's SALM data pipeline does, so context text and the audio
placeholder form one user message (``"Transcribe: <|audio|>"``).

Formats are classes registered in :data:`PROMPT_FORMATS`; a new chat template is a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dflash_train.data.conversation import Conversation, DataError
from dflash_train.errors import ConfigError


@dataclass
class Message:
    """One chat message after merging turns; ``supervised`` only for assistant replies."""

    role: str
    content: str
    supervised: bool = False


@dataclass
class Encoded:
    """Token ids and loss mask of one conversation (audio still one placeholder token each)."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool


class ChatMLFormat:
    """ChatML as Qwen's chat template writes it: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""

    name: ClassVar[str] = "qwen"
    begin: ClassVar[str] = "<|im_start|>"
    end: ClassVar[str] = "<|im_end|>"
    reply_prefix: ClassVar[str] = ""  # rendered after the assistant header, never supervised

    def __init__(self, tokenizer, audio_locator_tag: str):
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # NeMo AutoTokenizer wraps the HF one
        if not getattr(self.tokenizer, "is_fast", False):
            raise ConfigError("data.prompt_format needs a fast (Rust) HF tokenizer to align the loss mask")
        self.audio_locator_tag = audio_locator_tag
        tag_ids = self.tokenizer(audio_locator_tag, add_special_tokens=False)["input_ids"]
        if len(tag_ids) != 1:
            raise ConfigError(
                f"model.audio_locator_tag='{audio_locator_tag}' is {len(tag_ids)} tokens for the target tokenizer; "
                "it must be a single (special) token"
            )
        self.audio_locator_tag_id = int(tag_ids[0])

    def messages(self, conversation: Conversation) -> list[Message]:
        """Turns as chat messages: audio becomes the placeholder tag, consecutive non-assistant turns merge."""
        messages: list[Message] = []
        for turn in conversation.turns:
            content = self.audio_locator_tag if turn.audio is not None else turn.text
            if messages and turn.role != "assistant" and messages[-1].role == turn.role:
                messages[-1].content = f"{messages[-1].content} {content}"
            else:
                messages.append(Message(turn.role, content, turn.supervised))
        return messages

    def reply_content(self, content: str) -> str:
        """How the template writes an assistant reply's content."""
        return content

    def render(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The prompt string and the character spans ``[start, end)`` that are supervised."""
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        for message in messages:
            if message.role == "assistant":
                head = f"{self.begin}assistant\n{self.reply_prefix}"
                body = f"{self.reply_content(message.content)}{self.end}"
                if message.supervised:
                    spans.append((length + len(head), length + len(head) + len(body)))
            else:
                head, body = f"{self.begin}{message.role}\n", f"{message.content}{self.end}"
            parts += [head, body, "\n"]
            length += len(head) + len(body) + 1
        return "".join(parts), spans

    def encode(self, conversation: Conversation) -> Encoded:
        """Token ids and loss mask; an audio/placeholder count mismatch is a :class:`DataError`."""
        text, spans = self.render(self.messages(conversation))
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int32)
        starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        for begin, end in spans:
            mask |= (starts >= begin) & (starts < end)
        placeholders = int((ids == self.audio_locator_tag_id).sum())
        audios = len(conversation.audio_cuts)
        if placeholders != audios:
            raise DataError(
                f"sample '{conversation.id}' has {placeholders} audio placeholder(s) '{self.audio_locator_tag}' in its "
                f"tokens but {audios} audio(s); remove the tag from its text"
            )
        return Encoded(ids, mask)


class NemotronNanoV3Format(ChatMLFormat):
    """Nemotron nano v3 with thinking off: a system turn always (empty if none), and every reply
    written as ``<think></think>{content.strip()}``; the empty think block is not supervised."""

    name: ClassVar[str] = "nemotron_nano_v3"
    reply_prefix: ClassVar[str] = "<think></think>"

    def messages(self, conversation: Conversation) -> list[Message]:
        messages = super().messages(conversation)
        if messages[0].role != "system":
            messages.insert(0, Message("system", ""))
        return messages

    def reply_content(self, content: str) -> str:
        return content.strip()


PROMPT_FORMATS: dict[str, type[ChatMLFormat]] = {cls.name: cls for cls in (ChatMLFormat, NemotronNanoV3Format)}


def build_prompt_format(name: str, tokenizer, audio_locator_tag: str) -> ChatMLFormat:
    """The registered prompt format ``name`` bound to the target's tokenizer."""
    if name not in PROMPT_FORMATS:
        raise ConfigError(f"data.prompt_format='{name}' is unknown; choose one of {sorted(PROMPT_FORMATS)}")
    return PROMPT_FORMATS[name](tokenizer, audio_locator_tag)
