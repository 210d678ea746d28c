"""Readers of the supported input formats; each record becomes a :class:`Conversation`.

Every input is a re-iterable stream of raw records plus a function turning one record
into a conversation. Conversion checks the audio (the file exists, its header opens, the
segment lies inside it and is not empty; a file or shard member that can hold non-finite
samples, floating point or not read by libsndfile, is decoded and must hold only finite ones;
every other one is only opened at its header) and the text
to supervise (not empty), and raises :class:`SampleSkipped` otherwise. A file that is not
the JSONL it should be, or a record whose structure is wrong, raises :class:`DataError`
naming the file and line.

Audio of any channel count and sampling rate is accepted: it is resampled to the target's
rate with lhotse (``Cut.resample``) and its channels are averaged to one (a plain
mean) when a batch is collated.

Formats (docs/data.md has examples):

- ``lhotse_as_conversation`` + ``cuts_path``: a lhotse CutSet; the cut's offset and
  duration select the audio, ``supervisions[0].text`` is the reply.
- ``lhotse_as_conversation`` + ``manifest_filepath``: a NeMo ASR manifest
  (``audio_filepath``, ``duration``, ``text``, optional ``offset``, ``context``).
- ``multimodal_conversation`` + ``manifest_filepath``: NeMo's conversation JSONL
  (``id``, ``conversations: [{from, type: text|audio, value, duration, offset}]``).
- ``lhotse_as_conversation`` / ``lhotse_shar`` + ``shar_path``: a lhotse Shar directory, read by
  NeMo's own reader (``nemo.collections.common.data.lhotse.cutset``).
- ``lhotse_as_conversation`` / ``nemo_tarred`` + ``manifest_filepath`` + ``tarred_audio_filepaths``:
  NeMo tarred audio (brace-expanded shard lists), read by NeMo's ``LazyNeMoTarredIterator``.
  NeMo's reader drops an audio file it cannot decode with a log line; here every such
  manifest entry comes back as a counted ``unreadable_audio`` skip.

Shards are read in a fixed, seeded order, the same on every rank: the stream is deterministic
(exact resume) and rank *r* takes records ``i % world_size == r`` as for plain files.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
from lhotse import AudioSource, CutSet, Recording
from lhotse.cut import Cut, MixedCut

from dflash_train.config.schema import InputConfig
from dflash_train.data.conversation import ROLES, Conversation, DataError, SampleSkipped, Turn

CONTEXT_TAG = "context"
SYSTEM_PROMPT_TAG = "system_prompt"
TAG_KEYS = (CONTEXT_TAG, SYSTEM_PROMPT_TAG)
# Where an input's records come from, decided by which path keys it sets (see input_source).
CUTS, SHAR, MANIFEST, TARRED_MANIFEST = "cuts", "shar", "manifest", "tarred_manifest"
CONVERSATIONS, TARRED_CONVERSATIONS = "conversations", "tarred_conversations"
# Each type (NeMo's names) and the sources it may read; every ASR source becomes
# [system] [user: context] [user: audio] [assistant: transcript].
TYPE_SOURCES = {
    "lhotse_as_conversation": (CUTS, SHAR, MANIFEST, TARRED_MANIFEST),
    "lhotse": (CUTS, SHAR),
    "lhotse_shar": (SHAR,),
    "nemo": (MANIFEST,),
    "nemo_tarred": (TARRED_MANIFEST,),
    "multimodal_conversation": (CONVERSATIONS, TARRED_CONVERSATIONS),
}
INPUT_TYPES = tuple(TYPE_SOURCES)
# Path prefixes lhotse opens remotely (smart_open, AIStore, pipes): never checked as local files.
REMOTE_PREFIXES = ("s3://", "ais://", "gs://", "http://", "https://", "pipe:")


@dataclass
class Input:
    """One configured input: its records and the conversion of a record into a conversation."""

    weight: float
    records: Iterable[Any]
    convert: Callable[[Any], Conversation]


def input_path(cfg: InputConfig) -> str:
    """The file (or Shar directory) an input reads: ``cuts_path``, ``shar_path`` or ``manifest_filepath``."""
    for path in (cfg.cuts_path, cfg.shar_path, cfg.manifest_filepath):
        if path is not None:
            return path
    return None


def input_source(cfg: InputConfig) -> Optional[str]:
    """Which kind of records the input's path keys select (``None`` when they set no single path)."""
    paths = [p for p in (cfg.cuts_path, cfg.shar_path, cfg.manifest_filepath) if p is not None]
    if len(paths) != 1:
        return None
    if cfg.cuts_path is not None:
        return CUTS
    if cfg.shar_path is not None:
        return SHAR
    if cfg.type == "multimodal_conversation":
        return CONVERSATIONS if cfg.tarred_audio_filepaths is None else TARRED_CONVERSATIONS
    return MANIFEST if cfg.tarred_audio_filepaths is None else TARRED_MANIFEST


def is_remote(path: str) -> bool:
    """Whether lhotse opens ``path`` remotely (``s3://``, ``ais://``, ``http(s)://``, ``pipe:``...)."""
    return str(path).startswith(REMOTE_PREFIXES)


def expand_shards(path: str) -> list[str]:
    """NeMo's expansion of a sharded path (``audio_{0..7}.tar``, ``audio__OP_0..7_CL_.tar``, lists)."""
    from nemo.collections.common.data.lhotse.nemo_adapters import expand_sharded_filepaths

    return [str(p) for p in expand_sharded_filepaths(path)]


def input_name(cfg: InputConfig) -> str:
    """``cfg.name``, else the file name without its JSONL/JSON/GZ suffixes."""
    if cfg.name:
        return cfg.name
    name = Path(input_path(cfg)).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def open_input(cfg: InputConfig, system_prompt: Optional[str], sampling_rate: int, shard_seed: int = 0) -> Input:
    """Open one ``input_cfg`` entry lazily (nothing is read until iteration).

    ``shard_seed`` fixes the order in which a Shar input's shards are read; it must be the same
    on every rank (records are dealt to ranks by their index in that order).
    """
    tags = dict(cfg.tags or {})
    defaults = _Defaults(
        context=tags.get(CONTEXT_TAG),
        system_prompt=tags.get(SYSTEM_PROMPT_TAG, system_prompt),
        sampling_rate=sampling_rate,
    )
    path, source = input_path(cfg), input_source(cfg)
    if source == CUTS:
        cuts = CutRecords(path) if path.endswith((".jsonl", ".jsonl.gz")) else CutSet.from_file(path)
        return Input(cfg.weight, cuts, defaults.cut_to_conversation)
    if source == SHAR:
        return Input(cfg.weight, SharCuts(path, shard_seed), defaults.cut_to_conversation)
    if source == TARRED_MANIFEST:
        return Input(cfg.weight, TarredCuts(path, cfg.tarred_audio_filepaths), defaults.cut_to_conversation)
    supervise_last_only = cfg.assistant_turns == "last"
    if source == TARRED_CONVERSATIONS:
        return Input(
            cfg.weight,
            TarredConversations(path, cfg.tarred_audio_filepaths),
            lambda record: defaults.nemo_conversation_to_conversation(record, supervise_last_only),
        )
    records = JsonlRecords(path)
    if source == MANIFEST:
        return Input(cfg.weight, records, defaults.nemo_entry_to_conversation)
    return Input(
        cfg.weight, records, lambda record: defaults.conversation_record_to_conversation(record, supervise_last_only)
    )


@dataclass(frozen=True)
class JsonRecord:
    """One parsed JSONL line and where it came from (for error messages and default ids)."""

    path: str
    line: int
    data: dict

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def require(self, key: str) -> Any:
        """``data[key]``, or a :class:`DataError` naming the file, line and key."""
        if key not in self.data:
            raise DataError(f"{self.where}: record has no '{key}' key")
        return self.data[key]


class JsonlRecords:
    """Re-iterable JSONL (optionally gzipped) reader yielding :class:`JsonRecord` objects."""

    def __init__(self, path: str):
        self.path = str(path)

    def __iter__(self) -> Iterator[JsonRecord]:
        gzipped = self.path.endswith(".gz")
        line_no = 0
        try:
            with _open_text(self.path) as handle:
                for line_no, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        data = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{self.path}:{line_no}: not valid JSON ({err.msg})") from None
                    if not isinstance(data, dict):
                        raise DataError(f"{self.path}:{line_no}: expected a JSON object per line")
                    yield JsonRecord(self.path, line_no, data)
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as err:
            kind = "gzipped UTF-8 JSONL" if gzipped else "UTF-8 JSONL"
            raise DataError(
                f"{self.path}:{line_no + 1}: cannot be read as {kind} ({type(err).__name__}: {err})"
            ) from None


def _open_text(path: str):
    """A text handle on a (gzipped) JSONL file: local files directly, remote ones through lhotse's ``open_best``."""
    if is_remote(path):
        from lhotse.serialization import open_best

        return open_best(path, "r")  # smart_open: decompresses .gz by the name
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, "rt", encoding="utf-8")


class CutRecords:
    """Re-iterable cuts of a lhotse ``.jsonl`` / ``.jsonl.gz`` manifest, read line by line, so a
    broken line is a :class:`DataError` naming the file and line (lhotse's reader raises a bare
    ``JSONDecodeError``)."""

    def __init__(self, path: str):
        self.lines = JsonlRecords(path)

    def __iter__(self) -> Iterator[Cut]:
        from lhotse.cut.set import deserialize_cut

        for record in self.lines:
            try:
                yield deserialize_cut(record.data)
            except Exception as err:  # whatever lhotse trips on, the line is not a cut
                raise DataError(f"{record.where}: not a lhotse cut ({type(err).__name__}: {err})") from None


class SharCuts:
    """Re-iterable cuts of a lhotse Shar directory, read by NeMo's ``lhotse_shar`` parser.

    The shards are shuffled with the integer ``shard_seed`` (the same order on every rank and
    every run) and the set is finite: the data module repeats and blends it.
    """

    def __init__(self, shar_path: str, shard_seed: int):
        self.shar_path = shar_path
        self.shard_seed = shard_seed

    def __iter__(self) -> Iterator[Cut]:
        from nemo.collections.common.data.lhotse.cutset import get_parser_fn
        from omegaconf import OmegaConf

        config = OmegaConf.create({"shar_path": self.shar_path, "shard_seed": self.shard_seed, "force_finite": True})
        cuts, _ = get_parser_fn("lhotse_shar")(config)
        yield from cuts


# NeMo's tarred manifests name segments of one tar member "<stem>-sub<k><ext>"
_SEGMENT_SUFFIX = re.compile(r"^(?P<stem>.+)-sub\d+(?P<ext>\.\w+)?$")


def tar_member_name(audio_filepath: str) -> str:
    """The tar member a tarred manifest entry's ``audio_filepath`` is read from (NeMo's ``-subK`` rule)."""
    match = _SEGMENT_SUFFIX.match(audio_filepath)
    return audio_filepath if match is None else match.group("stem") + (match.group("ext") or "")


@dataclass(frozen=True)
class UndecodableEntry:
    """A tarred manifest entry whose audio NeMo's reader could not decode (it yields nothing for it)."""

    shard: str
    entry: str


class TarredCuts:
    """Re-iterable cuts of NeMo tarred audio, read by NeMo's ``LazyNeMoTarredIterator`` in shard-id order.

    NeMo's reader skips an audio file it cannot decode (and a tar it cannot read) with a log
    line only. This reader compares each shard's manifest with what came out of it and yields
    an :class:`UndecodableEntry` for every entry that did not, so the skip is counted.
    """

    def __init__(self, manifest_filepath: str, tarred_audio_filepaths: str):
        self.manifest_filepath = manifest_filepath
        self.tarred_audio_filepaths = tarred_audio_filepaths

    def __iter__(self) -> Iterator[Cut | UndecodableEntry]:
        from nemo.collections.common.data.lhotse.nemo_adapters import LazyNeMoTarredIterator

        reader = LazyNeMoTarredIterator(self.manifest_filepath, self.tarred_audio_filepaths, shuffle_shards=False)
        order = reader.shard_ids  # the reader's order without shuffling
        position_of_tar = {str(reader.shard_id_to_tar_path[sid]): i for i, sid in enumerate(order)}
        produced: dict[int, set[str]] = {sid: set() for sid in order}
        finished = 0  # shards order[:finished] are done

        def close_shards(upto: int) -> Iterator[UndecodableEntry]:
            for sid in order[finished:upto]:
                tar = str(reader.shard_id_to_tar_path[sid])
                for entry in reader.shard_id_to_manifest[sid]:
                    name = tar_member_name(str(entry["audio_filepath"]))
                    if not entry.get("_skipme", False) and name not in produced[sid]:
                        yield UndecodableEntry(tar, str(entry["audio_filepath"]))

        for cut in reader:
            position = position_of_tar[str(cut.tar_origin)]
            yield from close_shards(position)
            finished = position
            produced[order[position]].add(str(cut.recording_id))  # the tar member it was decoded from
            yield cut
        yield from close_shards(len(order))


@dataclass(frozen=True)
class UnreadShardRest:
    """A conversation of a tarred shard after one whose audio NeMo's reader could not decode.

    NeMo's conversation reader stops at such a file (its tar stream cannot continue), so the
    rest of that shard is not read; each of its conversations is counted, never dropped silently.
    """

    shard: str
    line: int
    cause: str


class TarredConversations:
    """Re-iterable conversations of NeMo's tarred conversation format (``manifest_<k>.jsonl`` +
    ``audio_<k>.tar``, as ``NeMoMultimodalConversationTarWriter`` writes them), read shard by shard
    in the given order by NeMo's ``NeMoMultimodalConversationJsonlAdapter``.

    A shard whose audio fails to decode yields an :class:`UndecodableEntry` for the conversation
    being read and an :class:`UnreadShardRest` for each later one; the next shard is read as usual.
    """

    def __init__(self, manifest_filepath: str, tarred_audio_filepaths: str):
        self.manifests = expand_shards(manifest_filepath)
        self.tars = expand_shards(tarred_audio_filepaths)
        if len(self.manifests) != len(self.tars):
            raise DataError(
                f"tarred conversations: {len(self.manifests)} manifests ({manifest_filepath}) but "
                f"{len(self.tars)} tars ({tarred_audio_filepaths}); give one tar per manifest"
            )

    def __iter__(self) -> Iterator[Any]:
        from nemo.collections.common.data.lhotse.text_adapters import NeMoMultimodalConversationJsonlAdapter

        for manifest, tar in zip(self.manifests, self.tars):
            reader = NeMoMultimodalConversationJsonlAdapter(
                manifest_filepath=manifest, tarred_audio_filepaths=tar, audio_locator_tag="<audio>"
            )
            read = 0
            try:
                for conversation in reader:
                    read += 1
                    yield conversation
            except Exception as err:  # NeMo's tar reader cannot go on past an undecodable file
                lines = [record.data for record in JsonlRecords(manifest)]  # only now: which lines were not read
                kept = [i for i, data in enumerate(lines) if not (data.get("custom") or {}).get("_skipme")]
                unread = kept[read:]  # NeMo yields the kept lines in order
                cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                if unread:
                    yield UndecodableEntry(tar, f"conversation at {manifest}:{unread[0] + 1} ({cause})")
                for i in unread[1:]:
                    yield UnreadShardRest(tar, i + 1, cause)


def _skip_unread(record: Any) -> None:
    """Raise the counted skip a shard reader's placeholder stands for (a record NeMo's reader could not give)."""
    if isinstance(record, UndecodableEntry):
        raise SampleSkipped("unreadable_audio", f"{record.shard}: NeMo's reader could not decode {record.entry}")
    if isinstance(record, UnreadShardRest):
        raise SampleSkipped(
            "after_unreadable_audio",
            f"{record.shard}: conversation at line {record.line} follows undecodable audio in its shard",
        )


@dataclass(frozen=True)
class _Defaults:
    """Per-input defaults applied while converting records."""

    context: Optional[str]
    system_prompt: Optional[str]
    sampling_rate: int

    def _head_turns(self, system_prompt: Optional[str], context: Optional[str]) -> list[Turn]:
        turns = []
        if system_prompt:
            turns.append(Turn("system", text=system_prompt))
        if context:
            turns.append(Turn("user", text=context))
        return turns

    def cut_to_conversation(self, cut: Cut | UndecodableEntry) -> Conversation:
        """[system] [user: context] [user: audio] [assistant: ``supervisions[0].text``]."""
        _skip_unread(cut)
        if not cut.supervisions:
            raise SampleSkipped("no_supervision", f"cut '{cut.id}' has no supervision")
        reply = _reply_text(cut.supervisions[0].text, cut.id)
        audio = checked_audio(cut, cut.id, self.sampling_rate)
        custom = cut.custom or {}
        turns = self._head_turns(
            custom.get(SYSTEM_PROMPT_TAG, self.system_prompt), custom.get(CONTEXT_TAG, self.context)
        )
        turns += [Turn("user", audio=audio), Turn("assistant", text=reply, supervised=True)]
        return Conversation(cut.id, turns)

    def nemo_entry_to_conversation(self, record: JsonRecord) -> Conversation:
        """A NeMo ASR manifest line, converted like a cut (``offset`` and ``duration`` select the audio)."""
        sample_id = f"{Path(record.path).name}:{record.line}"
        audio_path = record.require("audio_filepath")
        duration = float(record.require("duration"))
        reply = _reply_text(record.require("text"), sample_id)
        audio = _segment(record, audio_path, record.data.get("offset", 0.0), duration, sample_id, self.sampling_rate)
        turns = self._head_turns(
            record.data.get(SYSTEM_PROMPT_TAG, self.system_prompt), record.data.get(CONTEXT_TAG, self.context)
        )
        turns += [Turn("user", audio=audio), Turn("assistant", text=reply, supervised=True)]
        return Conversation(sample_id, turns)

    def conversation_record_to_conversation(self, record: JsonRecord, supervise_last_only: bool) -> Conversation:
        """A multi-turn conversation; assistant turns are supervised (all, or only the last one)."""
        sample_id = str(record.data.get("id", f"{Path(record.path).name}:{record.line}"))
        raw_turns = record.require("conversations")
        if not isinstance(raw_turns, list):
            raise DataError(f"{record.where}: 'conversations' must be a list of turns")
        turns = [self._turn(record, raw, index, sample_id) for index, raw in enumerate(raw_turns)]
        return self._supervised_conversation(sample_id, turns, supervise_last_only)

    def nemo_conversation_to_conversation(self, conversation: Any, supervise_last_only: bool) -> Conversation:
        """A conversation read by NeMo's reader (``NeMoMultimodalConversation``), supervised like the JSONL form."""
        _skip_unread(conversation)
        from nemo.collections.common.data.lhotse.text_adapters import AudioTurn

        sample_id = str(conversation.id)
        turns = []
        for turn in conversation.turns:
            role = str(turn.role).lower()
            if role not in ROLES:
                raise DataError(f"conversation '{sample_id}': unknown role '{turn.role}' (expected User, Assistant or System)")
            if isinstance(turn, AudioTurn):
                turns.append(Turn(role, audio=checked_audio(turn.cut, sample_id, self.sampling_rate)))
            else:
                turns.append(Turn(role, text=str(turn.value)))
        return self._supervised_conversation(sample_id, turns, supervise_last_only)

    def _supervised_conversation(self, sample_id: str, turns: list[Turn], supervise_last_only: bool) -> Conversation:
        """Mark the supervised replies, drop what follows the last one, add the input's context and system prompt."""
        assistant = [i for i, turn in enumerate(turns) if turn.role == "assistant" and turn.text is not None]
        chosen = assistant[-1:] if supervise_last_only else assistant
        if not chosen:
            raise SampleSkipped("no_supervised_turn", f"conversation '{sample_id}' has no assistant text turn")
        for i in chosen:
            turns[i].supervised = True
            turns[i].text = _reply_text(turns[i].text, sample_id)
        turns = turns[: chosen[-1] + 1]  # turns after the last supervised reply teach nothing
        if self.context and turns[0].role == "user" and turns[0].audio is not None:
            turns.insert(0, Turn("user", text=self.context))
        if self.system_prompt and turns[0].role != "system":
            turns.insert(0, Turn("system", text=self.system_prompt))
        return Conversation(sample_id, turns)

    def _turn(self, record: JsonRecord, raw: Any, index: int, sample_id: str) -> Turn:
        where = f"{record.where}: turn {index}"
        if not isinstance(raw, dict) or not {"from", "type", "value"} <= raw.keys():
            raise DataError(f"{where}: a turn needs 'from', 'type' and 'value'")
        role = str(raw["from"]).lower()
        if role not in ROLES:
            raise DataError(f"{where}: unknown role from='{raw['from']}' (expected User, Assistant or System)")
        if raw["type"] == "text":
            return Turn(role, text=str(raw["value"]))
        if raw["type"] != "audio":
            raise DataError(f"{where}: unknown type='{raw['type']}' (expected text or audio)")
        duration = raw.get("duration")
        audio = _segment(record, raw["value"], raw.get("offset", 0.0), duration, sample_id, self.sampling_rate)
        return Turn(role, audio=audio)


def _reply_text(text: Optional[str], sample_id: str) -> str:
    if text is None or not str(text).strip():
        raise SampleSkipped("empty_transcript", f"sample '{sample_id}' has an empty reply")
    return str(text)


def resolve_audio_path(path: str, manifest_path: str) -> Path:
    """A manifest's relative audio path: next to the manifest if it exists there, else as given."""
    candidate = Path(path)
    if candidate.is_absolute():
        return candidate
    beside = Path(manifest_path).parent / candidate
    return beside if beside.exists() else candidate


# libsndfile subtypes whose samples are stored as floats and so can be NaN or infinite
FLOAT_SUBTYPES = frozenset({"FLOAT", "DOUBLE"})


@dataclass(frozen=True)
class OpenedAudio:
    """A file's recording metadata, and whether its samples can be non-finite (must be decoded to know)."""

    recording: Recording
    may_be_nonfinite: bool


def _open_recording(path: Path, sample_id: str) -> OpenedAudio:
    """The file's recording metadata from its header; a missing or unopenable file is a skip.

    libsndfile reads the header directly (it is the hot path: every rank checks every sample
    it prepares); other formats go through lhotse's backends.
    """
    import soundfile

    if not path.is_file():
        raise SampleSkipped("missing_audio", f"sample '{sample_id}': {path} does not exist")
    try:
        header = soundfile.info(str(path))
    except Exception:  # not a libsndfile format, or broken: let lhotse's backends decide
        header = None
    if header is not None:
        recording = Recording(
            id=path.stem,
            sources=[AudioSource(type="file", channels=list(range(header.channels)), source=str(path))],
            sampling_rate=int(header.samplerate),
            num_samples=int(header.frames),
            duration=header.frames / header.samplerate,
        )
        return OpenedAudio(recording, header.subtype in FLOAT_SUBTYPES)
    try:
        return OpenedAudio(Recording.from_file(str(path)), True)
    except Exception as err:  # any decoder failure means the same thing here
        raise SampleSkipped("unreadable_audio", f"sample '{sample_id}': cannot open {path} ({type(err).__name__})")


def _check_finite(cut: Cut, sample_id: str, path: Any) -> None:
    """Decode ``cut`` (one file's segment, at its own rate) and skip the sample if any value is NaN or infinite."""
    try:
        samples = cut.load_audio()
    except Exception as err:
        raise SampleSkipped("unreadable_audio", f"sample '{sample_id}': cannot decode {path} ({type(err).__name__})")
    if not np.isfinite(samples).all():
        bad = int((~np.isfinite(samples)).sum())
        raise SampleSkipped("nonfinite_audio", f"sample '{sample_id}': {path} holds {bad} NaN or infinite samples")


def _check_in_memory(part: Cut, data: bytes, sample_id: str) -> None:
    """A shard's in-memory audio: its header when libsndfile reads it (no decode unless the samples are
    floats, which must be checked for NaN); other formats, or bytes no header parser accepts, are decoded
    once here so that an undecodable member is a counted skip rather than a failed batch."""
    import soundfile

    try:
        header = soundfile.info(io.BytesIO(data))
    except Exception:  # not a libsndfile format, or not audio at all: let the decoders decide
        header = None
    if header is None or header.subtype in FLOAT_SUBTYPES:
        _check_finite(part, sample_id, f"{part.recording.id} (in a shard)")


def _segment(
    record: JsonRecord, audio_path: str, offset: float, duration: Optional[float], sample_id: str, sampling_rate: int
) -> Cut:
    """The ``[offset, offset + duration)`` segment of a manifest's audio file as a checked cut."""
    opened = _open_recording(resolve_audio_path(str(audio_path), record.path), sample_id)
    recording = opened.recording
    offset = float(offset or 0.0)
    duration = recording.duration - offset if duration is None else float(duration)
    if duration <= 0 or recording.num_samples == 0:
        raise SampleSkipped("empty_audio", f"sample '{sample_id}': {audio_path} segment has zero length")
    _check_range(offset + duration, recording.duration, sample_id, audio_path)
    cut = recording.to_cut().truncate(offset=offset, duration=duration, preserve_id=True)
    if opened.may_be_nonfinite:
        _check_finite(cut, sample_id, audio_path)
    return _at_rate(cut.with_id(sample_id), sampling_rate)


def _check_range(end: float, file_duration: float, sample_id: str, path: Any) -> None:
    from lhotse.audio.utils import get_audio_duration_mismatch_tolerance

    if end > file_duration + get_audio_duration_mismatch_tolerance():
        raise SampleSkipped(
            "audio_out_of_range",
            f"sample '{sample_id}': segment ends at {end:.3f}s but {path} lasts {file_duration:.3f}s",
        )


def _at_rate(cut: Cut, sampling_rate: int) -> Cut:
    return cut if cut.sampling_rate == sampling_rate else cut.resample(sampling_rate)


def checked_audio(cut: Cut, sample_id: str, sampling_rate: int) -> Cut:
    """``cut`` at the target's sampling rate, after checking every audio file behind it.

    Raises :class:`SampleSkipped` when a file is missing or unreadable, when the segment is
    empty, runs past the end of its file or holds non-finite samples.
    """
    if cut.duration <= 0:
        raise SampleSkipped("empty_audio", f"sample '{sample_id}' has a zero-length audio segment")
    parts = [track.cut for track in cut.tracks] if isinstance(cut, MixedCut) else [cut]
    recorded = [part for part in parts if getattr(part, "has_recording", False)]
    if not recorded:
        raise SampleSkipped("missing_audio", f"sample '{sample_id}' has no recording")
    for part in recorded:
        for source in part.recording.sources:
            if source.type == "memory":  # read from a shard: its header (an undecodable file is a skip)
                _check_in_memory(part, source.source, sample_id)
                continue
            if source.type != "file":  # remote (url, ...): opened when the batch is loaded
                continue
            opened = _open_recording(Path(source.source), sample_id)
            if opened.recording.num_samples == 0:
                raise SampleSkipped("empty_audio", f"sample '{sample_id}': {source.source} has no samples")
            _check_range(part.start + part.duration, opened.recording.duration, sample_id, source.source)
            if opened.may_be_nonfinite:
                _check_finite(part, sample_id, source.source)
    return _at_rate(cut, sampling_rate)
