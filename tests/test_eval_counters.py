"""Acceptance counters, pooling, the report's numbers and its JSON, WER: no model needed."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from dflash_train.evaluate import AcceptanceCounters, EvalReport, Generation, RequestFailure, SampleResult
from dflash_train.evaluate.report import ReportMismatch
from dflash_train.evaluate.wer import corpus_wer

K = 7
SETTINGS = {
    "target": {"checkpoint": "ckpt", "config_name": None, "config_dir": None, "overrides": [], "description": "ckpt"},
    "drafts": {"draft": "export"},
    "num_speculative_tokens": K,
    "max_new_tokens": 64,
    "dtype": "float32",
    "device": "cpu",
}


def _sample(index, accepted_per_round, tokens=None, draft_tokens=None, reference="hello world"):
    tokens = tokens if tokens is not None else list(range(1 + sum(a + 1 for a in accepted_per_round)))
    target = Generation(tokens, "stop", "hello world")
    draft = Generation(draft_tokens if draft_tokens is not None else tokens, "stop", "hello world", accepted_per_round)
    return SampleResult(index, f"utt-{index}", reference, target, {"draft": draft})


def test_mal_and_per_position_rates_follow_the_definitions():
    counters = AcceptanceCounters.from_rounds(3, [3, 0, 1, 2])
    assert (counters.rounds, counters.proposed, counters.accepted) == (4, 12, 6)
    assert counters.mal == 1 + 6 / 4
    assert counters.accepted_per_position == [3, 2, 1] and counters.proposed_per_position == [4, 4, 4]
    rows = counters.positions()
    assert [r.rate for r in rows] == [3 / 4, 2 / 4, 1 / 4]
    assert [r.conditional for r in rows] == [3 / 4, 2 / 3, 1 / 2]
    assert math.isnan(AcceptanceCounters(3).mal)
    with pytest.raises(ValueError):
        counters.observe(3, 4)


def test_counters_pool_by_addition_and_refuse_mixed_k():
    a, b = AcceptanceCounters.from_rounds(3, [3, 1]), AcceptanceCounters.from_rounds(3, [0])
    assert (a + b).to_dict() == AcceptanceCounters.from_rounds(3, [3, 1, 0]).to_dict()
    with pytest.raises(ValueError, match="K=3 and K=2"):
        a + AcceptanceCounters(2)


def test_report_gives_pooled_mal_not_a_mean_of_per_request_means():
    # one short request accepting everything once, one long request accepting nothing in 9 rounds
    report = EvalReport(SETTINGS, 2, [_sample(0, [7]), _sample(1, [0] * 9)], [])
    per_request = [AcceptanceCounters.from_rounds(K, s.drafts["draft"].accepted_per_round).mal for s in report.samples]
    assert per_request == [8.0, 1.0] and statistics.mean(per_request) == 4.5
    pooled = 1 + 7 / 10
    assert report.counters("draft").mal == pooled
    data = report.to_dict()
    assert data["drafts"]["draft"]["acceptance"]["mal"] == pooled
    assert "mean" not in json.dumps(data["drafts"]).lower()
    assert f"{pooled:.3f}" in report.format_table() and "4.500" not in report.format_table()


def test_report_states_k_definitions_counts_failures_truncations_and_mismatches(tmp_path):
    truncated = _sample(1, [2, 2])
    truncated.target.finish_reason = truncated.drafts["draft"].finish_reason = "length"
    changed = _sample(2, [1], draft_tokens=[0, 1, 9])
    failure = RequestFailure(3, "utt-3", "SampleSkipped: missing_audio: gone.wav does not exist")
    report = EvalReport(SETTINGS, 4, [_sample(0, [7]), truncated, changed], [failure])
    data = report.to_dict()
    assert data["settings"]["num_speculative_tokens"] == K and data["provisional"] is True
    assert set(data["counter_definitions"]) >= {"MAL", "accepted@k", "conditional@k", "rounds"}
    assert (data["samples_expected"], data["samples_evaluated"]) == (4, 3)
    assert data["failures"] == [{"index": 3, "id": "utt-3", "error": failure.error}]
    assert data["drafts"]["draft"]["truncated_ids"] == ["utt-1"] and data["target_only"]["truncated_ids"] == ["utt-1"]
    assert data["drafts"]["draft"]["greedy_equal"] is False
    assert data["drafts"]["draft"]["mismatches"] == [{"id": "utt-2", "first_differing_position": 2}]
    per_position = data["drafts"]["draft"]["acceptance"]["per_position"]
    assert [p["k"] for p in per_position] == list(range(1, K + 1))
    table = report.format_table()
    assert "PROVISIONAL" in table and "utt-3" in table and "GREEDY MISMATCH" in table
    # the JSON document is the report: reading it back gives the same numbers
    again = EvalReport.read_json(report.write_json(tmp_path / "r.json"))
    assert again.to_dict() == json.loads(json.dumps(data))
    assert report.plot(tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_merges_only_under_identical_settings_and_never_twice():
    first = EvalReport(SETTINGS, 2, [_sample(0, [7])], [RequestFailure(1, "utt-1", "RuntimeError: boom")])
    rerun = EvalReport(SETTINGS, 1, [_sample(1, [0, 0])], [])
    merged = first.merged_with(rerun)
    assert not merged.provisional and [s.id for s in merged.samples] == ["utt-0", "utt-1"]
    assert merged.counters("draft").to_dict() == AcceptanceCounters.from_rounds(K, [7, 0, 0]).to_dict()
    with pytest.raises(ReportMismatch, match="different settings"):
        first.merged_with(EvalReport({**SETTINGS, "max_new_tokens": 32}, 1, [_sample(1, [0])], []))
    with pytest.raises(ReportMismatch, match="already evaluated"):
        first.merged_with(EvalReport(SETTINGS, 1, [_sample(0, [7])], []))


def test_wer_normalizes_with_whisper_english_and_skips_empty_references():
    hypotheses = ["Hello, World!", "anything", "the colour"]
    result = corpus_wer(["a", "b", "c"], hypotheses, ["hello world", "", "the color is"])
    assert result.errors == 1 and result.reference_words == 5 and result.unscored_ids == ("b",)
    assert result.wer == pytest.approx(1 / 5)
    assert result.to_dict()["normalizer"] == "whisper_normalizer.english.EnglishTextNormalizer"


def test_eval_command_fails_on_a_greedy_mismatch_and_flags_failed_samples(monkeypatch, capsys, tmp_path):
    """Exit status contract of dflash-eval: 1 for a mismatch, 3 for failed samples, 0 otherwise."""
    import dflash_train.evaluate.run as run
    from dflash_train.cli import eval as eval_cli

    reports = {
        "clean": EvalReport(SETTINGS, 1, [_sample(0, [7])], []),
        "mismatch": EvalReport(SETTINGS, 1, [_sample(0, [1], draft_tokens=[0, 5])], []),
        "failed": EvalReport(SETTINGS, 2, [_sample(0, [7])], [RequestFailure(1, "utt-1", "RuntimeError: boom")]),
    }
    monkeypatch.setattr(run, "prepare", lambda *args, **kwargs: (None, None))
    cuts = tmp_path / "c.jsonl"
    cuts.write_text("{}\n")  # --cuts must name a non-empty file; prepare() is replaced, so it is never read
    for name, expected in (("clean", 0), ("mismatch", 1), ("failed", 3)):
        monkeypatch.setattr(run, "evaluate", lambda settings, loaded, report=reports[name]: report)
        code = eval_cli.main(["--target", "t", "--draft", "d", "--cuts", str(cuts),
                              "--json", str(tmp_path / f"{name}.json")])
        assert code == expected, name
        assert (tmp_path / f"{name}.json").exists() and (tmp_path / f"{name}.png").exists()
    out = capsys.readouterr().out
    assert "GREEDY MISMATCH (draft): first differing position by sample {'utt-0': 1}" in out
