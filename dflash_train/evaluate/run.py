"""Evaluate drafts the way serving will run them: settings, loading, the per-sample loop.

:func:`prepare` resolves every default once (K, stop tokens, prompt format, data) and
loads the target and drafts; :func:`evaluate` decodes each request with the target alone
and with every draft, under identical settings, and returns an :class:`EvalReport`. A
sample that fails anywhere (bad audio, an exception while decoding) is recorded as a
failure with its id and contributes to no number.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch import nn

from dflash_train.config.schema import InputConfig
from dflash_train.errors import ConfigError
from dflash_train.evaluate.decoder import Decoded, StopRule, proposer_for, speculative_decode
from dflash_train.evaluate.loading import (
    SERVING_PERCEPTION_DTYPE,
    TargetContext,
    TargetSource,
    default_stop_token_ids,
    export_training_step,
    load_draft,
    load_mtp_heads,
    load_target_context,
    weights_digest,
)
from dflash_train.evaluate.report import EvalReport, Generation, SampleResult
from dflash_train.evaluate.requests import (
    EvalRequest,
    RequestFailure,
    greedy_reply,
    prompt_inputs,
    read_requests,
    reply_text,
)
from dflash_train.evaluate.session import TargetSession
from dflash_train.progress import progress
from dflash_train.target.vllm_export import draft_speculative_tokens

log = logging.getLogger(__name__)

DRAFT = "draft"
BASELINE = "baseline"
MTP = "mtp"
TARGET_MTP_HEADS = "(the target's MTP heads)"
"""The export path recorded for the MTP heads stored in the target checkpoint itself (``dflash-eval --mtp``)."""


@dataclass(frozen=True)
class EvalSettings:
    """Everything that fixes an evaluation's numbers; a re-run with equal settings measures the same thing."""

    target: TargetSource
    drafts: dict[str, str]  # name -> export directory
    data: InputConfig
    prompt_format: str
    system_prompt: Optional[str]
    num_speculative_tokens: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    dtype: str
    device: str
    perception_dtype: str = SERVING_PERCEPTION_DTYPE
    draft_sha256: dict[str, str] = field(default_factory=dict)  # name -> weights digest: a re-run uses the same
    draft_training_steps: dict[str, Optional[int]] = field(default_factory=dict)  # name -> global step of the export
    limit: Optional[int] = None
    sample_ids: Optional[tuple[str, ...]] = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["target"] = {**self.target.to_dict(), "description": self.target.describe()}
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["sample_ids"] = list(self.sample_ids) if self.sample_ids is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "EvalSettings":
        target = {k: v for k, v in data["target"].items() if k != "description"}
        return cls(
            **{
                **data,
                "target": TargetSource.from_dict(target),
                "data": InputConfig(**data["data"]),
                "stop_token_ids": tuple(data["stop_token_ids"]),
                "sample_ids": tuple(data["sample_ids"]) if data.get("sample_ids") is not None else None,
                # A report from before perception_dtype was recorded ran the perception in ``dtype``.
                "perception_dtype": data.get("perception_dtype", data["dtype"]),
            }
        )


@dataclass
class Loaded:
    """The target (with prompt format, estimator) and the drafts an evaluation runs with."""

    context: TargetContext
    drafts: dict[str, nn.Module]


def prepare(
    target: TargetSource,
    drafts: dict[str, str],
    data: Optional[InputConfig],
    *,
    prompt_format: Optional[str] = None,
    system_prompt: Optional[str] = None,
    num_speculative_tokens: Optional[int] = None,
    max_new_tokens: int = 128,
    stop_token_ids: Optional[list[int]] = None,
    dtype: str = "float32",
    perception_dtype: str = SERVING_PERCEPTION_DTYPE,
    device: str = "cpu",
    limit: Optional[int] = None,
    sample_ids: Optional[list[str]] = None,
) -> tuple[EvalSettings, Loaded]:
    """Resolve defaults (flags first, then the recipe's validation input and prompt) and load everything.

    K defaults to what each draft serves with (``block_size - 1``; an EAGLE-3 draft's ``ttt_steps``), which
    the drafts must agree on in a comparison.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    context = load_target_context(
        target, data, "validation", prompt_format, system_prompt, dtype, device, perception_dtype
    )
    loaded_drafts, served_k = {}, {}
    for name, path in drafts.items():
        if path == TARGET_MTP_HEADS:
            loaded_drafts[name], served_k[name] = load_mtp_heads(context.checkpoint(), context.target, device, dtype)
        else:
            loaded_drafts[name] = load_draft(path, context.target, device, dtype)
            served_k[name] = draft_speculative_tokens(path)
    if num_speculative_tokens is None:
        if len(set(served_k.values())) != 1:
            raise ConfigError(f"the drafts serve different K {served_k}; pass --num-speculative-tokens")
        num_speculative_tokens = next(iter(served_k.values()))
    if num_speculative_tokens < 1:
        raise ConfigError(f"--num-speculative-tokens {num_speculative_tokens} must be >= 1")
    settings = EvalSettings(
        target=target,
        drafts=dict(drafts),
        data=context.data,
        prompt_format=context.prompt_format.name,
        system_prompt=context.system_prompt,
        num_speculative_tokens=num_speculative_tokens,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_token_ids or default_stop_token_ids(context.prompt_format)),
        dtype=dtype,
        device=device,
        perception_dtype=perception_dtype,
        draft_sha256={name: weights_digest(_weights_of(path, context.checkpoint())) for name, path in drafts.items()},
        draft_training_steps={
            name: export_training_step(_weights_of(path, context.checkpoint())) for name, path in drafts.items()
        },
        limit=limit,
        sample_ids=tuple(sample_ids) if sample_ids else None,
    )
    return settings, Loaded(context, loaded_drafts)


def _weights_of(path: str, target_checkpoint: Optional[str]) -> str:
    """The directory whose weights a draft's numbers depend on: the export, or the target for its MTP heads."""
    return target_checkpoint if path == TARGET_MTP_HEADS else path


def reload(settings: EvalSettings) -> Loaded:
    """Load the models of a recorded evaluation, with its settings unchanged (a re-run).

    A draft export whose weights changed since is an error: its numbers would not pool.
    """
    changed = [
        name
        for name, sha in settings.draft_sha256.items()
        if weights_digest(_weights_of(settings.drafts[name], settings.target.checkpoint)) != sha
    ]
    if changed:
        raise ConfigError(f"the weights of draft(s) {changed} changed since the report was written; evaluate anew")
    _, loaded = prepare(
        settings.target,
        settings.drafts,
        settings.data,
        prompt_format=settings.prompt_format,
        system_prompt=settings.system_prompt,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_new_tokens=settings.max_new_tokens,
        stop_token_ids=list(settings.stop_token_ids),
        dtype=settings.dtype,
        perception_dtype=settings.perception_dtype,
        device=settings.device,
    )
    return loaded


def _generation(decoded: Decoded, text: str) -> Generation:
    return Generation(decoded.token_ids, decoded.finish_reason, text, decoded.accepted_per_round)


def evaluate_request(settings: EvalSettings, loaded: Loaded, request: EvalRequest) -> SampleResult:
    """Target-only and speculative greedy decoding of one request."""
    target = loaded.context.target
    rule = StopRule(settings.max_new_tokens, frozenset(settings.stop_token_ids))
    embeds, ids = prompt_inputs(target, request.prompt)

    prompt_format = loaded.context.prompt_format
    reference, reference_text = greedy_reply(target, prompt_format, embeds, rule)
    outputs = {}
    for name, draft in loaded.drafts.items():
        proposer, layer_ids = proposer_for(draft, target, settings.num_speculative_tokens)
        decoded = speculative_decode(TargetSession(target, layer_ids), proposer, embeds, rule, ids)
        outputs[name] = _generation(decoded, reply_text(prompt_format, decoded))
    return SampleResult(request.index, request.id, request.reference, _generation(reference, reference_text), outputs)


def _selected_count(settings: EvalSettings, indices: Optional[set[int]]) -> Optional[int]:
    """How many records the run evaluates when it names them (a re-run's indices, ``--sample-ids``), else unknown."""
    counts = [len(set(selected)) for selected in (indices, settings.sample_ids) if selected is not None]
    return min(counts) if counts else None


def evaluate(settings: EvalSettings, loaded: Loaded, indices: Optional[set[int]] = None) -> EvalReport:
    """Evaluate every selected request (``indices``: only those records, for a re-run)."""
    requests = read_requests(
        settings.data,
        loaded.context.prompt_format,
        loaded.context.estimator,
        system_prompt=settings.system_prompt,
        limit=settings.limit,
        indices=indices,
        sample_ids=set(settings.sample_ids) if settings.sample_ids is not None else None,
    )
    samples, failures = [], []
    for request in progress(requests, "dflash-eval", total=_selected_count(settings, indices)):
        if isinstance(request, RequestFailure):
            failures.append(request)
            log.warning("sample %s failed: %s", request.id, request.error)
            continue
        try:
            samples.append(evaluate_request(settings, loaded, request))
        except Exception as err:  # any failure of one sample is recorded by id; the others go on
            if isinstance(err, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            failures.append(RequestFailure(request.index, request.id, f"{type(err).__name__}: {err}"))
            log.warning("sample %s failed: %s: %s", request.id, type(err).__name__, err)
            continue
    expected = len(samples) + len(failures)
    return EvalReport(settings.to_dict(), expected, samples, failures)


def rerun_failed(report: EvalReport) -> EvalReport:
    """Evaluate ``report``'s failed samples again under its exact settings and merge them in."""
    if not report.failures:
        return report
    settings = EvalSettings.from_dict(report.settings)
    rerun = evaluate(settings, reload(settings), indices={f.index for f in report.failures})
    return report.merged_with(rerun)
