"""Serve a SALM target with vLLM (optionally with a DFlash draft) on real audio and measure acceptance.

    python -m dflash_train.vllm_plugin.serving --target runs/demo/target --draft runs/demo/export \\
        --cuts demo_assets/data/val_cuts.jsonl.gz [--limit 8] [--max-tokens 48]

runs the target alone and then with the draft at K = block_size - 1, both greedy, checks
that the two outputs are equal token for token, and prints the pooled acceptance report
(:mod:`dflash_train.vllm_plugin.acceptance`). Prompts are built from a validation set the
way training builds them (the data pipeline's conversation, rendered by the target's chat
template with the generation prompt), so serving sees what the draft was trained on.

The engine runs in-process with the settings vLLM's CPU build needs (:data:`CPU_ENGINE_ARGS`);
on a GPU pass other ``engine_args``. Needs vLLM (the ``.venv-vllm`` test venv).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from dflash_train.constants import SAMPLE_RATE
from dflash_train.evaluate.counters import AcceptanceCounters
from dflash_train.target.vllm_export import CPU_SERVER_ARGS, draft_method, draft_speculative_tokens
from dflash_train.vllm_plugin.acceptance import ServingReport, SpecDecodeSnapshot, first_mismatches

# vLLM-CPU: eager mode, bf16, an explicit KV-cache budget (no GPU memory to profile), stats on for
# the spec-decode counters, one in-process worker, and room for the 40 s dummy audio NeMo's plugin
# profiles with (~500 audio frames).
CPU_ENGINE_ARGS = dict(
    **CPU_SERVER_ARGS,
    enforce_eager=True,
    dtype="bfloat16",
    disable_log_stats=False,
    distributed_executor_backend="uni",
    limit_mm_per_prompt={"audio": 1},
    seed=0,
)


@dataclass
class Request:
    """One prompt: its id, the rendered chat prompt (one audio placeholder per audio) and the audio.

    ``index`` is the record's place in its input, ``reference`` the reply the record holds
    (the transcript WER is scored against), ``messages`` the turns the prompt renders
    (``role``, ``content`` with the placeholders), what a server's chat endpoint is sent.
    """

    id: str
    prompt: str
    audios: list[np.ndarray]
    index: int = 0
    reference: str = ""
    messages: tuple = ()

    def engine_input(self) -> dict:
        """The prompt as vLLM's ``generate`` / ``add_request`` take it."""
        return {"prompt": self.prompt, "multi_modal_data": {"audio": [(a, SAMPLE_RATE) for a in self.audios]}}


@dataclass
class ServingRun:
    """What one engine produced for a list of requests."""

    token_ids: list[list[int]]
    finish_reasons: list[Optional[str]]
    counters: Optional[AcceptanceCounters]




def read_serving_requests(
    inp,
    tokenizer,
    limit: Optional[int] = None,
    prompt_format: str = "qwen",
    system_prompt: Optional[str] = None,
    sample_ids: Optional[set[str]] = None,
) -> list:
    """Serving prompts of an input (an :class:`~dflash_train.config.schema.InputConfig`), built like training samples.

    Returns, in file order, a :class:`Request` per usable record and a
    :class:`~dflash_train.evaluate.requests.RequestFailure` (id and error) per record that
    could not become one (unreadable audio, malformed record): the same ids ``dflash-eval``
    gives. ``limit`` keeps the first N records, ``sample_ids`` only the named ones.
    The conversation comes from the data pipeline (system prompt, context, audio turn); every
    turn before the reply is rendered with the tokenizer's chat template plus its generation
    prompt, which is what ``vllm serve``'s chat endpoint does.
    """
    from dflash_train.data.inputs import open_input
    from dflash_train.data.prompt import build_prompt_format
    from dflash_train.evaluate.requests import RequestFailure, last_reply, selected_records
    from dflash_train.target.vllm_export import AUDIO_LOCATOR_TAG

    source = open_input(inp, system_prompt, SAMPLE_RATE)
    chat = build_prompt_format(prompt_format, tokenizer, AUDIO_LOCATOR_TAG)
    out = []
    for index, rid, record in selected_records(inp, source, limit, sample_ids=sample_ids):
        try:
            conversation = source.convert(record)
            audios = [cut.load_audio()[0].astype(np.float32) for cut in conversation.audio_cuts]
        except Exception as err:  # one record's failure (unreadable audio, malformed) is recorded by id
            out.append(RequestFailure(index, rid, f"{type(err).__name__}: {err}"))
            continue
        messages = chat.messages(conversation)
        while messages and messages[-1].role == "assistant":
            messages.pop()
        turns = tuple({"role": m.role, "content": m.content} for m in messages)
        prompt = tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=True)
        out.append(Request(conversation.id, prompt, audios, index, last_reply(conversation), turns))
    return out


def validation_requests(
    cuts_path: str | Path,
    tokenizer,
    limit: int,
    prompt_format: str = "qwen",
    system_prompt: Optional[str] = None,
) -> list[Request]:
    """The first ``limit`` samples of a lhotse cut set as serving prompts; a record that fails is an error."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.requests import RequestFailure

    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts_path))
    requests = read_serving_requests(inp, tokenizer, limit, prompt_format, system_prompt)
    failed = [r for r in requests if isinstance(r, RequestFailure)]
    if failed:
        raise ValueError(f"'{cuts_path}' sample {failed[0].id} cannot be served: {failed[0].error}")
    if not requests:
        raise ValueError(f"'{cuts_path}' holds no usable sample")
    return requests


def speculative_config(draft: str | Path | None, num_speculative_tokens: Optional[int]) -> Optional[dict]:
    """vLLM's ``speculative_config``: a draft export (DFlash or EAGLE-3), the target's MTP heads (K only), or none."""
    if draft is not None:
        k = num_speculative_tokens if num_speculative_tokens is not None else draft_speculative_tokens(draft)
        return {"method": draft_method(draft), "model": str(draft), "num_speculative_tokens": k}
    if num_speculative_tokens is not None:
        return {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
    return None


def serve(
    target: str | Path,
    requests: Sequence[Request],
    max_tokens: int,
    draft: str | Path | None = None,
    num_speculative_tokens: Optional[int] = None,
    **engine_args,
) -> ServingRun:
    """Greedy-decode ``requests`` on a fresh in-process engine, speculatively when asked.

    With ``draft``, its method (dflash, or eagle3 for an EAGLE-3 export; K defaults to the export's
    ``block_size - 1``, or its ``ttt_steps``); with only
    ``num_speculative_tokens``, method mtp (the target's own MTP heads). The engine is shut down
    before returning, so runs can follow each other in one process. Spec-decode counters are
    measured as the difference of snapshots around the run.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    args = {**CPU_ENGINE_ARGS, **engine_args}
    speculative = speculative_config(draft, num_speculative_tokens)
    if speculative is not None:
        args["speculative_config"] = speculative
    llm = LLM(model=str(target), **args)
    try:
        before = SpecDecodeSnapshot.from_metrics(llm.get_metrics()) if speculative is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = llm.generate([r.engine_input() for r in requests], params, use_tqdm=False)
        after = SpecDecodeSnapshot.from_metrics(llm.get_metrics()) if before is not None else None
    finally:
        shutdown_engine(llm)
    return ServingRun(
        token_ids=[list(o.outputs[0].token_ids) if o.outputs else [] for o in outputs],
        finish_reasons=[o.outputs[0].finish_reason if o.outputs else None for o in outputs],
        counters=(after - before).counters() if before is not None else None,
    )


def shutdown_engine(llm) -> None:
    """Stop an in-process engine and release its distributed state so another can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def report(run: ServingRun) -> ServingReport:
    """The acceptance report of a speculative run (failures: requests without a normal finish)."""
    if run.counters is None:
        raise ValueError("a run without a draft has no acceptance to report")
    return ServingReport(
        counters=run.counters,
        requests=len(run.token_ids),
        generated_tokens=sum(len(ids) for ids in run.token_ids),
        failures=sum(reason not in ("stop", "length") for reason in run.finish_reasons),
        truncated=sum(reason == "length" for reason in run.finish_reasons),
    )


def main(argv: list[str] | None = None) -> int:
    """Target-only and speculative runs, greedy-equality check, acceptance report; exit 1 on a mismatch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="vLLM-ready SALM directory (dflash-export-target)")
    parser.add_argument("--draft", required=True, help="draft export directory")
    parser.add_argument("--cuts", required=True, help="lhotse cuts (.jsonl.gz) to build prompts from")
    parser.add_argument("--limit", type=int, default=8, help="samples to serve")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default block_size - 1)")
    parser.add_argument("--prompt-format", default="qwen")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    requests = validation_requests(args.cuts, AutoTokenizer.from_pretrained(args.target), args.limit, args.prompt_format)
    reference = serve(args.target, requests, args.max_tokens)
    speculative = serve(
        args.target, requests, args.max_tokens, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens
    )
    mismatches = first_mismatches(reference.token_ids, speculative.token_ids)
    print(report(speculative).format(f"{args.draft} on {args.target}"))
    print(
        f"greedy equality: {len(requests) - len(mismatches)}/{len(requests)} requests identical"
        + (f"; first differing token per request {mismatches}" if mismatches else "")
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
