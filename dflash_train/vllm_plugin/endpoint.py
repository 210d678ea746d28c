"""A running vLLM server (``vllm serve``) as the benchmark's engine: the OpenAI chat API and ``/metrics``.

A user deciding whether to deploy a draft has a server already running, with their own flags
(tensor parallelism, precision, K): ``dflash-serve-bench --endpoint URL`` measures that server
instead of starting an engine. Each request is the one the in-process mode builds (same id,
conversation, audio, decoding limit), sent as vLLM's server takes audio: the conversation's
turns with the audio as ``input_audio`` parts (WAV, base64). The turn's text keeps the audio
placeholder where the prompt has it; vLLM inserts a placeholder only for audio the text does not
already place, so the server renders exactly the prompt the in-process mode renders.

Replies are streamed: time to first token is the first chunk that carries a token, the latency
the end of the stream; token ids come from vLLM's ``return_token_ids`` extension. Acceptance
comes from the server's Prometheus counters (:mod:`~dflash_train.vllm_plugin.acceptance`) as
the difference over a phase; the server's finished-request counter says whether that difference
belongs to the measured requests alone (:class:`MetricsSnapshot`). stdlib only (``urllib``,
threads), vLLM-free.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from dflash_train.constants import SAMPLE_RATE
from dflash_train.evaluate.requests import RequestFailure
from dflash_train.vllm_plugin.acceptance import (
    MissingCounters,
    SpecDecodeSnapshot,
    finished_requests,
    prometheus_samples,
)
from dflash_train.vllm_plugin.bench_report import ServedRequest
from dflash_train.vllm_plugin.serving import Request

PROBE_SECONDS = 10.0
SERVER_STARTUP_SECONDS = 300.0
COUNTER_SETTLE_SECONDS = 10.0  # vLLM records a step's statistics just after it streams the step's tokens


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked (unreachable, not vLLM's OpenAI server, no audio model); one line."""


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself before anything is measured."""

    url: str
    model: str  # the served model's name (``/v1/models``): requests name it
    vllm_version: Optional[str]  # ``/version``
    num_speculative_tokens: Optional[int]  # K from the per-position spec-decode counters; None: no speculation


@dataclass(frozen=True)
class MetricsSnapshot:
    """The server's cumulative counters at one moment: spec decoding (None without it) and finished requests."""

    spec: Optional[SpecDecodeSnapshot]
    finished: int


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def metrics(url: str, timeout: float = PROBE_SECONDS) -> MetricsSnapshot:
    """The server's counters now (``GET /metrics``)."""
    samples = prometheus_samples(_get(f"{url}/metrics", timeout).decode())
    try:
        spec = SpecDecodeSnapshot.from_prometheus(samples)
    except MissingCounters:
        spec = None
    return MetricsSnapshot(spec, finished_requests(samples))


def probe(url: str, flag: str = "--endpoint") -> ServerInfo:
    """The served model, vLLM version and K of the server at ``url``; :class:`EndpointError` in one line when
    nothing answers there or it is not vLLM's OpenAI-compatible server."""
    url = url.rstrip("/")
    try:
        models = json.loads(_get(f"{url}/v1/models", PROBE_SECONDS))
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise EndpointError(f"{flag} {url}: no OpenAI-compatible server answers ({reason}); start `vllm serve` "
                            "there or give its base URL (http://HOST:PORT)") from None
    served = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    if not served:
        raise EndpointError(f"{flag} {url}: /v1/models lists no model")
    try:
        version = json.loads(_get(f"{url}/version", PROBE_SECONDS)).get("version")
        snapshot = metrics(url)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise EndpointError(f"{flag} {url}: answers /v1/models but not vLLM's /version or /metrics ({err}); "
                            "benchmark a vLLM server") from None
    k = len(snapshot.spec.accepted_per_position) if snapshot.spec is not None else None
    return ServerInfo(url, served[0], version, k)


def _wav_base64(audio) -> str:
    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, audio, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def chat_body(request: Request, model: str, max_tokens: int, audio_tag: str) -> dict:
    """The streamed, greedy chat-completion request for ``request``: its turns, each audio placeholder's audio
    as an ``input_audio`` part of the turn that places it (in order)."""
    audios = iter(request.audios)
    messages = []
    for message in request.messages:
        content = message["content"]
        count = content.count(audio_tag)
        if not count:
            messages.append({"role": message["role"], "content": content})
            continue
        parts = [{"type": "text", "text": content}]
        parts += [{"type": "input_audio", "input_audio": {"data": _wav_base64(next(audios)), "format": "wav"}}
                  for _ in range(count)]
        messages.append({"role": message["role"], "content": parts})
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def send(url: str, request: Request, body: bytes, timeout: float) -> ServedRequest | RequestFailure:
    """Send one streamed chat request and time it; a refusal or a broken stream fails this request alone."""
    http = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    submitted = time.perf_counter()
    first: Optional[float] = None
    token_ids: list[int] = []
    text: list[str] = []
    finish_reason = None
    try:
        with urllib.request.urlopen(http, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestFailure(request.index, request.id, f"server error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter()
                    token_ids += ids
                    text.append((choice.get("delta") or {}).get("content") or "")
                    finish_reason = choice.get("finish_reason") or finish_reason
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (ValueError, AttributeError):
            pass
        return RequestFailure(request.index, request.id, f"HTTP {err.code}: {' '.join(str(detail).split())}")
    except (urllib.error.URLError, OSError, ValueError) as err:
        return RequestFailure(request.index, request.id, f"{type(err).__name__}: {err}")
    latency = time.perf_counter() - submitted
    ttft = (first - submitted) if first is not None else float("nan")
    return ServedRequest(request.id, token_ids, "".join(text), finish_reason, latency, ttft)


def settled_metrics(url: str, before: MetricsSnapshot, finished: int) -> MetricsSnapshot:
    """The counters once the server has recorded ``finished`` more finished requests than ``before`` (vLLM
    records a step's statistics after streaming its tokens), or after :data:`COUNTER_SETTLE_SECONDS`."""
    deadline = time.monotonic() + COUNTER_SETTLE_SECONDS
    while True:
        now = metrics(url)
        if now.finished - before.finished >= finished or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@contextmanager
def launched_server(argv: Sequence[str], log: Path, startup_seconds: float = SERVER_STARTUP_SECONDS) -> Iterator[str]:
    """Start vLLM's OpenAI server as ``argv --port <free port>`` (its output to ``log``) and yield its base URL once
    ``/health`` answers; stopped on exit. :class:`EndpointError` naming ``log`` when it exits or never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log, "w") as out:
        process = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_seconds
        while True:
            if process.poll() is not None:
                raise EndpointError(f"the server exited with {process.returncode} (log: {log})")
            try:
                _get(f"{url}/health", 5)
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise EndpointError(f"no server answered within {startup_seconds:.0f} s (log: {log})") from None
                time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
