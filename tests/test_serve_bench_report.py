"""``dflash-serve-bench``'s report: what is scoped, what is provisional, how speed-up and percentiles are formed.

The engine side runs in ``tests/vllm_serving/test_serve_bench.py``; here the report is fed
measured requests written out by hand, so each aggregate can be checked against numbers
worked out independently.
"""

from __future__ import annotations

import json
import math

import pytest

from dflash_train.cli.serve_bench import main as serve_bench
from dflash_train.evaluate.report import nan_to_none
from dflash_train.evaluate.requests import RequestFailure
from dflash_train.vllm_plugin.bench_report import (
    TARGET_ONLY,
    Phase,
    ServeBenchReport,
    ServedConfig,
    ServedRequest,
    _percentiles,
)

K = 3
SETTINGS = {
    "command": ["dflash-serve-bench", "--target", "T", "--draft", "D", "--cuts", "c.jsonl.gz", "--out", "o"],
    "target": "T", "input": "c.jsonl.gz", "limit": None, "sample_ids": None, "max_tokens": 8, "concurrency": [1, 4],
    "repeats": 2, "warmup": 1, "dtype": "bfloat16", "device": "cpu", "max_num_seqs": 4, "engine_args": {},
}
REFERENCES = {"a": "one two three", "b": "four five", "c": "six"}


def _request(rid, tokens, latency, ttft=0.1, rounds=None, finish="stop", text=None):
    accepted = rounds
    return ServedRequest(rid, list(tokens), text if text is not None else REFERENCES[rid], finish, latency, ttft,
                         accepted, [K] * len(accepted) if accepted is not None else None)


def _phase(config, concurrency, repeat, seconds, requests, rejected=(), engine=None):
    return Phase(config, concurrency, repeat, seconds, requests, list(rejected), engine)


def _report(draft_b_tokens=(4, 5, 2), draft_b_finish="stop", engine_rounds=3, c_rejected=False, slowdowns=(1, 2)):
    """Target-only and one draft, concurrency 1 and 4, one repeat per slowdown (its phases take that many
    times as long)."""
    phases = []
    for repeat, slowdown in enumerate(slowdowns):
        for c, scale in ((1, 1.0), (4, 0.5)):
            target = [_request("a", [1, 2, 3, 2], 1.0 * scale), _request("b", [4, 5, 2], 0.8 * scale),
                      _request("c", [6, 2], 0.5 * scale)]
            phases.append(_phase(TARGET_ONLY, c, repeat, 2.0 * scale * slowdown, target))
            draft = [
                _request("a", [1, 2, 3, 2], 0.5 * scale, rounds=[2, 0]),  # 4 tokens: prefill 1 + (2+1) + ... rounds
                _request("b", list(draft_b_tokens), 0.4 * scale, rounds=[1], finish=draft_b_finish),
            ]
            rejected = []
            if c_rejected:
                rejected.append(RequestFailure(2, "c", "ValueError: prompt too long"))
            else:
                draft.append(_request("c", [6, 2], 0.3 * scale, rounds=[0]))
            engine = {"rounds": engine_rounds + (1 if not c_rejected else 0), "proposed": 0, "accepted": 3,
                      "accepted_per_position": [2, 1, 0]}
            draft_seconds = 1.0 if c == 1 else 0.25  # speed-up 2x at concurrency 1, 4x at 4
            phases.append(_phase("dflash", c, repeat, draft_seconds * slowdown, draft, rejected, engine))
    configs = [ServedConfig(TARGET_ONLY), ServedConfig("dflash", "dflash", "/exp/d", K, 300),
               ServedConfig("dflash2", "dflash", "/exp/d2", K, 200, unservable="ValidationError: V1 does not support")]
    return ServeBenchReport(dict(SETTINGS, repeats=len(slowdowns)), dict(REFERENCES), [], configs, phases)


def test_acceptance_is_pooled_over_every_repeats_completed_requests_rounds():
    report = _report()
    second = report.phases_of("dflash", 1)[1]  # batching split request a's rounds differently the second time
    second.requests[0].accepted_per_round, second.requests[0].drafted_per_round = [2], [K]
    second.engine_counters = dict(second.engine_counters, rounds=3)
    counters = report.counters("dflash", 1)
    # repeat 0: a [2, 0], b [1], c [0] -> 4 rounds, 3 accepted, accepted@1 = 2 (a's first, b's), accepted@2 = 1
    # repeat 1: a [2], b [1], c [0] -> 3 rounds, 3 accepted, accepted@1 = 2, accepted@2 = 1
    assert (counters.rounds, counters.accepted, counters.accepted_per_position) == (7, 6, [4, 2, 0])
    assert counters.mal == pytest.approx(1 + 6 / 7)
    summary = report.summary("dflash", 1)
    assert summary.engine_counters_match is True and not summary.provisional  # summed over both phases


def test_a_failed_request_contributes_nothing_and_makes_the_row_provisional():
    report = _report(draft_b_finish="abort", engine_rounds=3)
    summary = report.summary("dflash", 1)
    counters = report.counters("dflash", 1)
    assert (counters.rounds, counters.accepted) == (6, 4)  # b's round excluded: a [2, 0] + c [0], two repeats
    assert summary.evaluated == 2 and summary.failed_ids == ["b"]
    # the engine-wide counters (4 rounds, 3 accepted) still hold b's partial round: flagged, row provisional
    assert summary.engine_counters_match is False and summary.provisional
    assert summary.greedy_equal == "2/2"  # compared only where both completed
    assert "rounds of failed requests" in report.markdown() and "--sample-id b" in report.markdown()


def test_a_rejected_request_is_failed_by_id_and_excluded():
    report = _report(c_rejected=True)
    summary = report.summary("dflash", 4)
    assert summary.failed_ids == ["c"] and summary.evaluated == 2 and summary.provisional
    assert report.counters("dflash", 4).rounds == 6  # a [2, 0] + b [1] in each of two repeats
    assert report.rerun_command().endswith("--out o --sample-id c")


def test_throughput_is_the_median_over_repeats_and_speedup_their_ratio():
    report = _report(slowdowns=(1, 2, 6))  # three repeats, one slow: the median is not the mean
    # concurrency 1: target 9 tokens in 2, 4 and 12 s; draft 9 tokens in 1, 2 and 6 s
    target, draft = report.summary(TARGET_ONLY, 1), report.summary("dflash", 1)
    assert target.throughput_per_repeat == pytest.approx([4.5, 2.25, 0.75])
    assert target.output_tokens_per_s == pytest.approx(2.25)  # the mean would be 2.5
    assert draft.speedup == pytest.approx(2.0) and draft.speedup_per_repeat == pytest.approx([2.0, 2.0, 2.0])
    assert draft.requests_per_s == pytest.approx(3 / 2)  # the mean would be 1.667
    assert report.summary("dflash", 4).speedup == pytest.approx(4.0)  # against target-only at concurrency 4


def test_greedy_equality_and_wer_are_checked_against_target_only_at_the_same_concurrency():
    report = _report(draft_b_tokens=(4, 9, 2))
    summary = report.summary("dflash", 4)
    assert summary.greedy_equal == "2/3" and summary.mismatched_ids == ["b"]
    assert summary.wer["wer"] == 0.0  # the texts given are the references
    assert "output differs from target-only on b" in report.markdown()


def test_latency_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(1, 101)]
    p = _percentiles(values)
    assert (p["p50"], p["p90"], p["p99"]) == pytest.approx((50.5, 90.1, 99.01))
    assert all(math.isnan(v) for v in _percentiles([]).values())
    # every completed request of every repeat: a, b, c latencies 1.0, 0.8, 0.5 twice
    assert _report().summary(TARGET_ONLY, 1).latency["p50"] == pytest.approx(0.8)


def test_time_per_output_token_excludes_the_first_token():
    request = _request("a", [1, 2, 3, 4, 5], latency=1.3, ttft=0.5)
    assert request.tpot == pytest.approx(0.8 / 4)
    assert math.isnan(_request("c", [6], latency=0.2).tpot)


def test_json_round_trip_gives_the_same_aggregates(tmp_path):
    report = _report(draft_b_finish="abort")
    path = report.write_json(tmp_path / "report.json")
    again = ServeBenchReport.read_json(path)
    assert nan_to_none(again.to_dict()["summaries"]) == json.loads(path.read_text())["summaries"] != []
    assert again.summary("dflash", 1).failed_ids == ["b"] and math.isnan(again.phases[0].requests[0].tpot) is False


def test_markdown_has_a_row_per_configuration_and_concurrency_and_names_the_unservable_one(tmp_path):
    report = _report()
    text = report.markdown()
    rows = [line for line in text.splitlines() if line.startswith(("| target_only", "| dflash"))]
    assert [row.split("|")[1].strip() + "@" + row.split("|")[4].strip() for row in rows] == [
        "target_only@1", "target_only@4", "dflash@1", "dflash@4"]
    assert "| 2.00x |" in rows[2]
    assert "**dflash2** not served: ValidationError: V1 does not support" in text
    assert report.plot(tmp_path / "report.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "1,x"], "--concurrency '1,x'"),
        (["--concurrency", "0"], "--concurrency '0'"),
        (["--engine-arg", "max_model_len"], "--engine-arg 'max_model_len': write KEY=VALUE"),
        (["--repeats", "0"], "--repeats 0 must be >= 1"),
        (["--draft", "x", "-k", "0"], "--num-speculative-tokens 0 must be >= 1"),
        ([], "give --draft EXPORT"),
    ],
)
def test_bad_arguments_are_one_line_errors_before_any_engine_starts(argv, message, tmp_path, capsys, tiny_salm_dir,
                                                                   demo_data):
    code = serve_bench(["--target", str(tiny_salm_dir), "--cuts", str(demo_data[1]), "--out", str(tmp_path / "o"),
                        *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_two_drafts_with_one_name_are_refused(tmp_path, capsys, tiny_salm_dir, demo_data):
    export = tmp_path / "d"
    export.mkdir()
    (export / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "dflash_config": {"block_size": 4}}')
    code = serve_bench(["--target", str(tiny_salm_dir), "--cuts", str(demo_data[1]), "--out", str(tmp_path / "o"),
                        "--draft", str(export), "--draft", str(export)])
    assert code == 2 and "two configurations are named 'dflash'" in capsys.readouterr().err


def test_the_report_says_where_speculation_stops_paying_and_plots_throughput_against_interactivity(tmp_path):
    report = _report()
    # the draft's phase at concurrency 4 takes 3 s instead of 0.25 s: slower than target-only's 1 s there
    for phase in report.phases_of("dflash", 4):
        phase.seconds = 3.0
    assert report.summary("dflash", 1).speedup == pytest.approx(2.0)
    assert report.summary("dflash", 4).speedup == pytest.approx(3 / 6.75)  # 9 tokens in 3 s vs in 1 and 2 s
    assert report.stops_paying("dflash") == 4
    assert "- **dflash**: speculation stops paying at concurrency 4 (2.00x at 1, 0.44x at 4)" in report.markdown()
    assert "pays at every measured concurrency (2.00x at 1, 4.00x at 4)" in _report().markdown()
    # per user: the median request's tokens / latency; dflash at 1: a 4/0.5, b 3/0.4, c 2/0.3, both repeats
    assert report.summary("dflash", 1).per_user_tokens_per_s == pytest.approx(7.5)
    assert report.plot(tmp_path / "report.png").stat().st_size > 0


def test_compare_prints_the_deltas_and_the_ids_whose_output_differs(tmp_path, capsys):
    baseline, candidate = _report(), _report(draft_b_tokens=(4, 9, 2))
    for phase in candidate.phases_of("dflash", 1):  # the candidate's draft accepts one more token on request c
        phase.requests[2].accepted_per_round = [1]
    paths = [baseline.write_json(tmp_path / "a.json"), candidate.write_json(tmp_path / "b.json")]
    assert serve_bench(["compare", *map(str, paths)]) == 0
    table = capsys.readouterr().out
    # concurrency 1: baseline 4 rounds, 3 accepted (MAL 1.750); candidate 4 rounds, 4 accepted (MAL 2.000)
    assert "| dflash | 1 | 1.750 → 2.000 (+0.250) | +0.25 +0.00 +0.00 |" in table  # accepted@1: 2/4 → 3/4
    assert table.count("| b |") == 2 and "| target_only | 1 |" in table  # b differs at both concurrencies
    assert "dflash2" not in table.split("\n\n")[1]  # unservable in both: not a row


@pytest.mark.parametrize("field,change", [("max_tokens", {"max_tokens": 16}), ("dtype", {"dtype": "float32"}),
                                          ("sample ids", None)])
def test_compare_refuses_reports_of_different_requests_or_settings(tmp_path, capsys, field, change):
    candidate = _report()
    if change:
        candidate.settings.update(change)
    else:
        candidate.references["d"] = "seven"
    paths = [_report().write_json(tmp_path / "a.json"), candidate.write_json(tmp_path / "b.json")]
    assert serve_bench(["compare", *map(str, paths)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"differ in {field} (" in err


# ------------------------------------------------------------------ endpoint mode (a running server)

METRICS_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/srv/target"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="/srv/target"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/srv/target"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="/srv/target"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/srv/target"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="/srv/target"} 5.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/srv/target",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/srv/target",position="2"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/srv/target",position="1"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/srv/target",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/srv/target",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/srv/target",position="2"} 0.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/srv/target"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/srv/target"} 2.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="/srv/target"} 1.0
vllm:num_requests_running{engine="0",model_name="/srv/target"} 0.0
"""


def test_server_counters_are_read_from_prometheus_text_summed_over_engines():
    from dflash_train.vllm_plugin.acceptance import (
        MissingCounters,
        SpecDecodeSnapshot,
        finished_requests,
        prometheus_samples,
    )

    samples = prometheus_samples(METRICS_TEXT)
    snapshot = SpecDecodeSnapshot.from_prometheus(samples)
    assert snapshot == SpecDecodeSnapshot(50, 150, 75, (39, 21, 15))  # positions ordered by label, not by line
    assert finished_requests(samples) == 12
    counters = snapshot.counters()
    assert counters.num_speculative_tokens == 3 and counters.mal == pytest.approx(1 + 75 / 50)
    without = "\n".join(line for line in METRICS_TEXT.splitlines() if "per_pos" not in line)
    with pytest.raises(MissingCounters, match="num_accepted_tokens_per_pos_total"):
        SpecDecodeSnapshot.from_prometheus(prometheus_samples(without))


def _endpoint_report(attributed=(True, True)):
    """The draft's acceptance from server counter differences (no per-request rounds), one phase per repeat."""
    from dataclasses import asdict

    from dflash_train.evaluate.counters import AcceptanceCounters

    report = _report()
    server = asdict(AcceptanceCounters(K, rounds=4, proposed=12, accepted=3, accepted_per_position=[2, 1, 0],
                                       proposed_per_position=[4, 4, 4]))
    for concurrency, attributions in ((1, attributed), (4, (True, True))):
        for phase, attribution in zip(report.phases_of("dflash", concurrency), attributions):
            for request in phase.requests:
                request.accepted_per_round = request.drafted_per_round = None
            phase.engine_counters, phase.counters_attributed = dict(server), attribution
    return report


def test_server_counters_are_pooled_over_repeats_when_requests_carry_no_rounds():
    report = _endpoint_report()
    counters = report.counters("dflash", 1)
    # two repeats of the engine counters {rounds 4, accepted 3, accepted@k 2 1 0}, proposed = K x rounds
    assert (counters.rounds, counters.accepted, counters.accepted_per_position) == (8, 6, [4, 2, 0])
    assert counters.proposed_per_position == [8, 8, 8]
    summary = report.summary("dflash", 1)
    assert summary.engine_counters_match is None and not summary.provisional
    assert "from the server's spec-decode counters" in report.markdown()


def test_server_counters_with_other_traffic_make_the_row_provisional():
    report = _endpoint_report(attributed=(True, False))
    assert report.summary("dflash", 1).provisional and not report.summary("dflash", 4).provisional
    assert "the server finished other requests than the measured ones" in report.markdown()


def test_a_saved_baseline_report_gives_speedup_and_is_checked_first(tmp_path):
    from dflash_train.errors import InputFileError
    from dflash_train.vllm_plugin.bench_report import check_comparable

    saved = _report()
    measured = _report()
    measured.configs = [c for c in measured.configs if c.name != TARGET_ONLY]
    measured.phases = [p for p in measured.phases if p.config != TARGET_ONLY]
    assert measured.summary("dflash", 1).speedup is None
    check_comparable(saved, measured)
    measured.adopt_baseline(saved)
    assert measured.summary("dflash", 1).speedup == pytest.approx(2.0)
    assert measured.summary("dflash", 1).greedy_equal == "3/3"
    other = _report()
    other.settings["max_tokens"] = 16
    with pytest.raises(InputFileError, match="differ in max_tokens"):
        check_comparable(saved, other)


class _FakeServer:
    """An HTTP server that answers vLLM's /v1/models, /version and /metrics and refuses every chat request the
    way a server whose model takes no audio does (HTTP 400): what the CLI must reject before measuring."""

    def __enter__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body, kind="application/json"):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                pages = {"/v1/models": json.dumps({"data": [{"id": "text-only-model"}]}),
                         "/version": json.dumps({"version": "0.32.0"}), "/metrics": METRICS_TEXT}
                self._send(200, pages[self.path]) if self.path in pages else self._send(404, "{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(400, json.dumps({"error": {"message": "text-only-model does not support audio input"}}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_server_that_refuses_audio_is_one_line_before_anything_is_measured(tmp_path, capsys, tiny_salm_dir,
                                                                               demo_data):
    with _FakeServer() as url:
        code = serve_bench(["--endpoint", url, "--target", str(tiny_salm_dir), "--cuts", str(demo_data[1]),
                            "--limit", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "the warm-up request" in err and "HTTP 400: text-only-model does not support audio input" in err
    assert not (tmp_path / "o" / "report.json").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--endpoint", "http://127.0.0.1:9"], "--endpoint http://127.0.0.1:9: no OpenAI-compatible server answers"),
        (["--baseline-endpoint", "http://127.0.0.1:9"], "--baseline-endpoint and --baseline go with --endpoint"),
        (["--endpoint", "http://127.0.0.1:9", "--draft", "d"], "the server decides what is served"),
    ],
)
def test_endpoint_arguments_are_one_line_errors(argv, message, tmp_path, capsys, tiny_salm_dir, demo_data):
    code = serve_bench(["--target", str(tiny_salm_dir), "--cuts", str(demo_data[1]), "--out", str(tmp_path / "o"),
                        *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
