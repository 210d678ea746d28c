"""``dflash-serve-bench --endpoint``: a running ``vllm serve`` measured through its OpenAI API and ``/metrics``.

The server is the demo's printed CPU line (target + trained DFlash draft) with the flags that make it
serve as the in-process bench's engine does (float32, eager, no prefix or multimodal-processor cache:
every repeated request is computed afresh). The same requests at concurrency 1 and 4 must give the
in-process bench's greedy tokens and pooled counters exactly; the server's counter difference over a
phase must belong to the measured requests alone.
"""

from __future__ import annotations

import gzip
import json
import shlex

import numpy as np
import pytest
import soundfile as sf

from dflash_train.cli.serve_bench import main as serve_bench
from dflash_train.target.vllm_export import draft_speculative_tokens, serve_command
from dflash_train.vllm_plugin.bench_report import ServeBenchReport

from conftest import BENCH_MAX_TOKENS, BENCH_REQUESTS, running_server

AS_IN_PROCESS = ["--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]


@pytest.fixture(scope="module")
def endpoint(served_target, trained_dflash_export, tmp_path_factory):
    line = serve_command(served_target, trained_dflash_export, draft_speculative_tokens(trained_dflash_export), cpu=True)
    argv = shlex.split(line)
    with running_server([*argv[1:], *AS_IN_PROCESS], tmp_path_factory.mktemp("endpoint") / "server.log") as base:
        yield base


def _bench(base, served_target, cuts, out, *extra) -> tuple[int, ServeBenchReport]:
    code = serve_bench(["--endpoint", f"dflash={base}", "--target", str(served_target), "--cuts", str(cuts),
                        "--max-tokens", str(BENCH_MAX_TOKENS), "--concurrency", "1,4", "--warmup", "1",
                        "--out", str(out), *extra])
    return code, ServeBenchReport.read_json(out / "report.json")


@pytest.fixture(scope="module")
def endpoint_bench(endpoint, served_target, validation_cuts, tmp_path_factory):
    return _bench(endpoint, served_target, validation_cuts, tmp_path_factory.mktemp("endpoint_bench"),
                  "--limit", str(BENCH_REQUESTS))


def test_endpoint_gives_the_in_process_tokens_and_counters(endpoint_bench, in_process_bench, trained_dflash_export):
    code, report = endpoint_bench
    _, _, reference = in_process_bench
    assert code == 0 and report.settings["mode"] == "endpoint"
    assert report.config("dflash").num_speculative_tokens == draft_speculative_tokens(trained_dflash_export)
    assert report.settings["vllm_version"] == reference.settings["vllm_version"]
    for concurrency in (1, 4):
        served = {r.id: r.token_ids for r in report.phases_of("dflash", concurrency)[0].completed()}
        expected = {r.id: r.token_ids for r in reference.phases_of("dflash", concurrency)[0].completed()}
        assert len(served) == BENCH_REQUESTS and served == expected
        counters, expected_counters = (r.counters("dflash", concurrency) for r in (report, reference))
        assert counters.rounds > 0
        assert (counters.rounds, counters.proposed, counters.accepted, counters.accepted_per_position) == (
            expected_counters.rounds, expected_counters.proposed, expected_counters.accepted,
            expected_counters.accepted_per_position)
        assert all(p.counters_attributed for p in report.phases_of("dflash", concurrency))
        summary = report.summary("dflash", concurrency)
        assert not summary.provisional and summary.evaluated == BENCH_REQUESTS


def test_streamed_timings_are_consistent(endpoint_bench):
    _, report = endpoint_bench
    for phase in report.phases:
        for request in phase.completed():
            assert 0 < request.ttft <= request.latency <= phase.seconds
            assert 0 < len(request.token_ids) <= BENCH_MAX_TOKENS and request.text
    assert report.summary("dflash", 1).tpot["p50"] > 0


def test_a_request_the_server_refuses_fails_alone(endpoint, served_target, validation_cuts, tmp_path):
    """A prompt longer than the server's max_model_len (1024): HTTP 400 for that id, the other request measured,
    the report provisional with the command that re-runs the failed id."""
    with gzip.open(validation_cuts, "rt") as handle:
        first = json.loads(handle.readline())
    long = json.loads(json.dumps(first))
    audio, rate = sf.read(first["recording"]["sources"][0]["source"], dtype="float32")
    seconds = 100.0  # 1250 frames of 80 ms
    wav = tmp_path / "long.wav"
    sf.write(wav, np.resize(audio, int(seconds * rate)), rate)
    long["id"] = long["supervisions"][0]["id"] = "too-long"
    long["duration"] = long["supervisions"][0]["duration"] = long["recording"]["duration"] = seconds
    long["recording"]["num_samples"] = int(seconds * rate)
    long["recording"]["sources"][0]["source"] = str(wav)
    long["recording"]["id"] = long["supervisions"][0]["recording_id"] = "too-long"
    cuts = tmp_path / "cuts.jsonl.gz"
    with gzip.open(cuts, "wt") as handle:
        handle.write(json.dumps(first) + "\n" + json.dumps(long) + "\n")
    code, report = _bench(endpoint, served_target, cuts, tmp_path / "out")
    assert code == 3
    for concurrency in (1, 4):
        summary = report.summary("dflash", concurrency)
        assert summary.failed_ids == ["too-long"] and summary.evaluated == 1 and summary.provisional
    refusal = report.phases_of("dflash", 1)[0].rejected[0]
    assert refusal.id == "too-long" and refusal.error.startswith("HTTP 400")
    assert "--sample-id too-long" in (tmp_path / "out" / "report.md").read_text()
