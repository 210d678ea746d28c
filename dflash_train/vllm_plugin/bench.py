"""Serve the same audio requests through vLLM with and without drafts and measure what a deployment gets.

:func:`run_bench` starts one in-process vLLM engine per configuration (the target alone,
then each draft: DFlash / DFlash2 exports through this project's plugin, the target's own
MTP heads), warms it up, and serves every request once per concurrency level, keeping at
most ``concurrency`` requests in flight (a new one is submitted as soon as one finishes).
Each request's submission, first token and finish are timed here; each speculative
request's rounds come from vLLM's per-request spec-decode metrics. ``repeats`` > 1 runs
the whole set of configurations again, in alternating order, so slow drift of a noisy
machine falls on every configuration alike. The result is a
:class:`~dflash_train.vllm_plugin.bench_report.ServeBenchReport`.

A configuration the installed vLLM cannot start (DFlash2 on vLLM-CPU, MTP on a target
without MTP heads) is recorded with vLLM's reason and the others still run.

:func:`run_endpoint_bench` measures running servers instead (``--endpoint``, and
``--baseline-endpoint`` for the target alone): the same requests through the OpenAI chat API
(:mod:`~dflash_train.vllm_plugin.endpoint`), at most ``concurrency`` in flight, acceptance from
each server's counters over the phase.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Iterator, Optional, Sequence

from dflash_train.evaluate.requests import RequestFailure
from dflash_train.progress import progress
from dflash_train.vllm_plugin.acceptance import MissingCounters, SpecDecodeSnapshot
from dflash_train.vllm_plugin import endpoint
from dflash_train.vllm_plugin.bench_report import TARGET_ONLY, Phase, ServeBenchReport, ServedConfig, ServedRequest
from dflash_train.vllm_plugin.serving import CPU_ENGINE_ARGS, Request, shutdown_engine

log = logging.getLogger(__name__)

# On a GPU vLLM profiles memory and captures CUDA graphs itself; only what the measurement needs.
GPU_ENGINE_ARGS = dict(dtype="bfloat16", disable_log_stats=False, limit_mm_per_prompt={"audio": 1}, seed=0)
# Every request is served once per concurrency level and repeat: without these, the second time
# would reuse the first's prefill (prefix cache) and audio processing (multimodal processor cache),
# which distinct user requests never can.
FRESH_REQUESTS = dict(enable_prefix_caching=False, mm_processor_cache_gb=0)


def engine_args(device: str, dtype: str, max_num_seqs: int, overrides: Optional[dict] = None) -> dict:
    """vLLM engine arguments for ``device`` (``cpu``: :data:`CPU_ENGINE_ARGS`) with :data:`FRESH_REQUESTS`,
    then ``overrides``."""
    base = CPU_ENGINE_ARGS if device == "cpu" else GPU_ENGINE_ARGS
    return {**base, **FRESH_REQUESTS, "dtype": dtype, "max_num_seqs": max_num_seqs, **(overrides or {})}


@dataclass(frozen=True)
class BenchPlan:
    """What to measure: the target, the configurations, the requests' limits and the load."""

    target: str
    configs: Sequence[ServedConfig]
    max_tokens: int
    concurrency: Sequence[int]
    repeats: int
    warmup: int
    engine_args: dict


def run_bench(plan: BenchPlan, requests: Sequence[Request], data_failures: Sequence[RequestFailure],
              settings: dict) -> ServeBenchReport:
    """Serve ``requests`` under every configuration of ``plan``; ``settings`` is recorded in the report as is."""
    from vllm import SamplingParams

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens)
    configs = [replace(c) for c in plan.configs]  # copies: a refusal is recorded on the report's, not the plan's
    servable = [c for c in configs if c.unservable is None]
    total = plan.repeats * len(servable) * len(plan.concurrency)  # fewer when vLLM refuses a configuration
    phases = list(progress(_phases(plan, configs, requests, params), "dflash-serve-bench", total=total, unit="phase",
                           every=1))
    references = {r.id: r.reference for r in requests}
    return ServeBenchReport(settings, references, list(data_failures), configs, phases)


def _phases(plan: BenchPlan, configs: Sequence[ServedConfig], requests: Sequence[Request], params) -> Iterator[Phase]:
    """Every measured phase: per repeat, each configuration (alternating the order) on a fresh engine, warmed up,
    at each concurrency."""
    for repeat in range(plan.repeats):
        for config in configs if repeat % 2 == 0 else list(reversed(configs)):
            if config.unservable is not None:
                continue
            llm = _start_engine(plan, config)
            if llm is None:
                continue
            try:
                if plan.warmup:
                    _serve_phase(llm, config, requests[: plan.warmup], 1, -1, params)
                for concurrency in plan.concurrency:
                    phase = _serve_phase(llm, config, requests, concurrency, repeat, params)
                    log.debug("%s: concurrency %d, repeat %d: %.1f s", config.name, concurrency, repeat, phase.seconds)
                    yield phase
            finally:
                shutdown_engine(llm)


def _start_engine(plan: BenchPlan, config: ServedConfig):
    """A fresh engine for ``config``; ``None`` (and ``config.unservable`` set) when vLLM refuses it."""
    from vllm import LLM

    args = dict(plan.engine_args)
    if config.method is not None:
        spec = {"method": config.method, "num_speculative_tokens": config.num_speculative_tokens}
        if config.export is not None:
            spec["model"] = config.export
        args.update(speculative_config=spec, per_request_spec_decode_metrics="detailed")
    try:
        return LLM(model=plan.target, **args)
    except Exception as err:  # vLLM's refusal (e.g. "Model Runner V1 does not support ...") is the row's answer
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        config.unservable = refusal_reason(err)
        log.warning("%s cannot be served by the installed vLLM: %s", config.name, config.unservable)
        return None


def refusal_reason(err: BaseException) -> str:
    """vLLM's reason for refusing a configuration, on one line (a pydantic error: its messages)."""
    messages = [e.get("msg", "") for e in err.errors()] if callable(getattr(err, "errors", None)) else []
    text = "; ".join(m for m in messages if m) or " ".join(str(err).split()) or repr(err)
    return f"{type(err).__name__}: {text}"


def _snapshot(llm) -> Optional[SpecDecodeSnapshot]:
    try:
        return SpecDecodeSnapshot.from_metrics(llm.get_metrics())
    except MissingCounters:
        return None


def _serve_phase(llm, config: ServedConfig, requests: Sequence[Request], concurrency: int, repeat: int,
                 params) -> Phase:
    """Serve every request once with at most ``concurrency`` in flight; time each one."""
    engine = llm.llm_engine
    before = _snapshot(llm) if config.method is not None else None
    queue = list(requests)
    in_flight: dict[str, tuple[Request, float, Optional[float]]] = {}  # engine id -> (request, submitted, first token)
    served: list[ServedRequest] = []
    rejected: list[RequestFailure] = []
    start = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            request = queue.pop(0)
            engine_id = f"{config.name}-c{concurrency}-r{repeat}-{request.index}"
            submitted = time.perf_counter()
            try:
                engine.add_request(engine_id, request.engine_input(), params)
            except Exception as err:  # refused (e.g. prompt longer than max_model_len): this request fails alone
                rejected.append(RequestFailure(request.index, request.id, f"{type(err).__name__}: {err}"))
                continue
            in_flight[engine_id] = (request, submitted, None)
        if not in_flight:
            break
        if not engine.has_unfinished_requests():
            now = time.perf_counter()
            for request, submitted, _ in in_flight.values():
                served.append(ServedRequest(request.id, [], "", None, now - submitted, float("nan")))
            in_flight.clear()
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            request, submitted, first = in_flight[output.request_id]
            completion = output.outputs[0] if output.outputs else None
            if first is None and completion is not None and len(completion.token_ids) > 0:
                first = now
                in_flight[output.request_id] = (request, submitted, first)
            if output.finished:
                del in_flight[output.request_id]
                served.append(_served(request, completion, now - submitted,
                                      (first - submitted) if first is not None else float("nan")))
    seconds = time.perf_counter() - start
    after = _snapshot(llm) if before is not None else None
    counters = asdict((after - before).counters()) if before is not None and after is not None else None
    order = {r.id: i for i, r in enumerate(requests)}
    served.sort(key=lambda r: order[r.id])
    return Phase(config.name, concurrency, repeat, seconds, served, rejected, counters)


def _served(request: Request, completion, latency: float, ttft: float) -> ServedRequest:
    if completion is None:
        return ServedRequest(request.id, [], "", None, latency, ttft)
    metrics = completion.spec_decode_metrics
    return ServedRequest(
        request.id,
        list(completion.token_ids),
        completion.text,
        completion.finish_reason,
        latency,
        ttft,
        list(metrics.per_step_accepted) if metrics is not None else None,
        list(metrics.per_step_drafted) if metrics is not None else None,
    )


def target_only() -> ServedConfig:
    """The baseline configuration: the target without speculation."""
    return ServedConfig(TARGET_ONLY)


REQUEST_SECONDS = 600.0  # one request's limit against a server (a stuck stream fails that request alone)


@dataclass(frozen=True)
class EndpointPlan:
    """What to measure on running servers: each configuration's server, the requests' limit and the load."""

    servers: Sequence[tuple[ServedConfig, endpoint.ServerInfo]]
    max_tokens: int
    concurrency: Sequence[int]
    repeats: int
    warmup: int  # at least 1: the first request also checks that the server takes audio
    audio_tag: str


def run_endpoint_bench(plan: EndpointPlan, requests: Sequence[Request], data_failures: Sequence[RequestFailure],
                       settings: dict) -> ServeBenchReport:
    """Serve ``requests`` on every server of ``plan`` (repeats alternate the order, as in-process);
    :class:`~dflash_train.vllm_plugin.endpoint.EndpointError` in one line, before any measurement, when a
    server refuses the warm-up request (it does not serve the audio model, say)."""
    bodies = {(server.url, r.id): json.dumps(endpoint.chat_body(r, server.model, plan.max_tokens, plan.audio_tag)
                                             ).encode() for _, server in plan.servers for r in requests}
    for config, server in plan.servers:
        before = endpoint.metrics(server.url)
        warmup = requests[: max(plan.warmup, 1)]
        for request in warmup:
            result = endpoint.send(server.url, request, bodies[server.url, request.id], REQUEST_SECONDS)
            if isinstance(result, RequestFailure) or not result.completed:
                error = result.error if isinstance(result, RequestFailure) else f"finish reason {result.finish_reason}"
                raise endpoint.EndpointError(
                    f"{server.url} ({config.name}): the warm-up request {request.id} failed ({error}); serve the "
                    "vLLM-ready audio target there (dflash-export-target's output, this project's plugin installed)")
        endpoint.settled_metrics(server.url, before, len(warmup))  # the warm-up's counters land before phase one
    total = plan.repeats * len(plan.servers) * len(plan.concurrency)
    phases = list(progress(_endpoint_phases(plan, requests, bodies), "dflash-serve-bench", total=total,
                           unit="phase", every=1))
    references = {r.id: r.reference for r in requests}
    return ServeBenchReport(settings, references, list(data_failures), [c for c, _ in plan.servers], phases)


def _endpoint_phases(plan: EndpointPlan, requests: Sequence[Request], bodies: dict) -> Iterator[Phase]:
    for repeat in range(plan.repeats):
        servers = plan.servers if repeat % 2 == 0 else list(reversed(plan.servers))
        for config, server in servers:
            for concurrency in plan.concurrency:
                yield _endpoint_phase(server, config, requests, bodies, concurrency, repeat)


def _endpoint_phase(server: endpoint.ServerInfo, config: ServedConfig, requests: Sequence[Request], bodies: dict,
                    concurrency: int, repeat: int) -> Phase:
    """Every request once with at most ``concurrency`` in flight (a closed loop: the next is sent as one
    finishes); the server's counters before and after (once it has recorded the measured requests)."""
    before = endpoint.metrics(server.url)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(
            lambda r: endpoint.send(server.url, r, bodies[server.url, r.id], REQUEST_SECONDS), requests))
    seconds = time.perf_counter() - start
    served = [r for r in results if isinstance(r, ServedRequest)]
    rejected = [r for r in results if isinstance(r, RequestFailure)]
    after = endpoint.settled_metrics(server.url, before, len(served))
    counters = None
    if config.num_speculative_tokens is not None and before.spec is not None and after.spec is not None:
        counters = asdict((after.spec - before.spec).counters())
    attributed = after.finished - before.finished == len(served) and not rejected and all(r.completed for r in served)
    return Phase(config.name, concurrency, repeat, seconds, served, rejected, counters, attributed)
