"""Offline labels: the frozen target's own greedy transcripts as a new training file.

A draft serves next to the target, so what it must predict is the target's output, not
the dataset's. This module decodes every record of a training input greedily with the
target, using the prompt training and serving use (:mod:`dflash_train.evaluate.requests`),
and writes a copy of the input in the same format with the generated text as the
supervised reply. Everything else of a record is kept as it was: id, audio path, offset,
duration, context, system prompt, earlier turns; the replaced text is kept beside it
(``original_text`` / ``original_value``). Failed, truncated (no stop token within
``max_new_tokens``) and empty generations are left out and listed. Training on the file
with ``dflash.label_source=ground_truth`` is the offline-label workflow (docs/evaluation.md).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dflash_train.config.schema import InputConfig
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.inputs import CONVERSATIONS, CUTS, MANIFEST, input_path, input_source, is_remote
from dflash_train.data.prompt import ChatMLFormat
from dflash_train.errors import ConfigError
from dflash_train.evaluate.decoder import StopRule
from dflash_train.evaluate.requests import RequestFailure, greedy_reply, prompt_embeddings, read_requests
from dflash_train.progress import progress
from dflash_train.target import FrozenTarget

ORIGINAL_TEXT = "original_text"  # cuts (supervision custom field) and NeMo ASR manifests
ORIGINAL_VALUE = "original_value"  # the relabelled assistant turn of a conversation record


@dataclass
class Excluded:
    """A record left out of the labelled file, and why (``failed``, ``truncated`` or ``empty``)."""

    index: int
    id: str
    reason: str
    detail: str = ""


@dataclass
class LabelRun:
    """What a labelling pass wrote and left out; ``settings`` records how the labels were made."""

    output: str
    settings: dict
    written: int = 0
    excluded: list[Excluded] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "tool": "dflash-labels",
            "output": self.output,
            "settings": self.settings,
            "written": self.written,
            "excluded": [asdict(e) for e in self.excluded],
        }


def sidecar_path(output: str | Path) -> Path:
    """``<output without .gz/.jsonl/.json>.labels.json``: the settings and exclusions of a labelled file."""
    path = Path(output)
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return path.with_name(f"{name}.labels.json")


def relabel(inp: InputConfig, record: Any, text: str) -> Any:
    """A copy of ``record`` whose supervised reply is ``text``; the old reply kept beside it."""
    if inp.cuts_path is not None:
        from lhotse.utils import fastcopy

        first = record.supervisions[0]  # the one training reads
        custom = {**(first.custom or {}), ORIGINAL_TEXT: first.text}
        return fastcopy(record, supervisions=[fastcopy(first, text=text, custom=custom), *record.supervisions[1:]])
    data = json.loads(json.dumps(record.data))
    if inp.type == "lhotse_as_conversation":
        return {**data, "text": text, ORIGINAL_TEXT: data.get("text")}
    turns = data["conversations"]
    is_reply = [str(t.get("from", "")).lower() == "assistant" and t.get("type") == "text" for t in turns]
    last = max(i for i, reply in enumerate(is_reply) if reply)
    turns[last] = {**turns[last], "value": text, ORIGINAL_VALUE: turns[last]["value"]}
    return data


def _write(inp: InputConfig, records: list, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    if inp.cuts_path is not None:
        from lhotse import CutSet

        CutSet.from_cuts(records).to_file(str(output))
        return
    opener = gzip.open if output.suffix == ".gz" else open
    with opener(output, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _check_output(inp: InputConfig, output: Path) -> None:
    if input_source(inp) not in (CUTS, MANIFEST, CONVERSATIONS) or is_remote(input_path(inp)):
        raise ConfigError(
            f"dflash-labels rewrites local cuts, NeMo manifests or conversation JSONL files; '{input_path(inp)}' "
            f"({inp.type}) is sharded or remote: label a local manifest of it instead"
        )
    source = Path(inp.cuts_path or inp.manifest_filepath).resolve()
    if output.resolve() == source:
        raise ConfigError(f"--out '{output}' is the input itself; write the labels to a new file (originals are kept)")
    suffixes = (".jsonl", ".jsonl.gz") if inp.cuts_path is not None else (".json", ".jsonl", ".json.gz", ".jsonl.gz")
    if not output.name.endswith(suffixes):
        raise ConfigError(f"--out '{output}' must end with one of {list(suffixes)}")


def generate_labels(
    target: FrozenTarget,
    prompt_format: ChatMLFormat,
    estimator: AudioTokenEstimator,
    inp: InputConfig,
    rule: StopRule,
    output: str | Path,
    settings: dict,
    system_prompt: Optional[str] = None,
    limit: Optional[int] = None,
    sample_ids: Optional[set[str]] = None,
) -> LabelRun:
    """Label every selected record of ``inp`` with the target's greedy reply; write the file and its sidecar."""
    output = Path(output)
    _check_output(inp, output)
    run = LabelRun(str(output), settings)
    records = []
    requests = read_requests(inp, prompt_format, estimator, system_prompt, limit=limit, sample_ids=sample_ids)
    for request in progress(requests, "dflash-labels", total=len(sample_ids) if sample_ids is not None else None):
        if isinstance(request, RequestFailure):
            run.excluded.append(Excluded(request.index, request.id, "failed", request.error))
            continue
        try:
            decoded, text = greedy_reply(target, prompt_format, prompt_embeddings(target, request.prompt), rule)
        except Exception as err:  # one sample's failure is listed; the others are labelled
            run.excluded.append(Excluded(request.index, request.id, "failed", f"{type(err).__name__}: {err}"))
            continue
        if decoded.finish_reason != "stop":
            detail = f"no stop token in {len(decoded.token_ids)} tokens"
            run.excluded.append(Excluded(request.index, request.id, "truncated", detail))
        elif not text.strip():
            run.excluded.append(Excluded(request.index, request.id, "empty", "the target replied with nothing"))
        else:
            records.append(relabel(inp, request.record, text))
    _write(inp, records, output)
    run.written = len(records)
    sidecar_path(output).write_text(json.dumps(run.to_dict(), indent=2))
    return run
