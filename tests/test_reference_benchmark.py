"""The reference benchmark: the stored targets (NeMo's SALM with a Qwen3 LLM; a SpeechLM with a Nemotron-H LLM
of Mamba-2, attention and MoE blocks) transcribe, and the acceptance benchmark runs end to end on both.

Both tests need espeak-ng (the held-out audio is re-synthesized, never stored) and run offline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
TARGET = BENCH / "reference_target"
NEMOTRON_H_TARGET = BENCH / "reference_target_nemotron_h"
BOTH_TARGETS = pytest.mark.parametrize("target", [TARGET, NEMOTRON_H_TARGET], ids=["qwen3", "nemotron_h"])

@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import acceptance
        import train_reference_target

        yield train_reference_target, acceptance
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def held_out(bench, tmp_path_factory):
    """The first held-out test utterances, re-synthesized exactly as the stored target's card measured them."""
    return bench[0].held_out_cuts(tmp_path_factory.mktemp("held_out"))


@BOTH_TARGETS
def test_stored_target_is_small_and_in_salm_layout(target):
    files = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "llm_backbone/config.json", "card.json"} <= files
    config = json.loads((target / "config.json").read_text())
    assert config["pretrained_llm"] == "llm_backbone" and config["tokenizer_path"] == "."
    assert "optimizer" not in config and config["pretrained_weights"] is False
    assert sum((target / f).stat().st_size for f in files) < 20 * 2**20


def test_nemotron_h_target_is_stored_as_the_runbook_stores_its_targets():
    """SALMAutomodel's native names (Mamba parameters under ``_fp32_params``, packed experts), every block kind
    the card names, no MTP heads (the benchmark trains them)."""
    from safetensors import safe_open

    from transformers import AutoConfig

    backbone = AutoConfig.from_pretrained(NEMOTRON_H_TARGET / "llm_backbone")
    card = json.loads((NEMOTRON_H_TARGET / "card.json").read_text())
    assert backbone.model_type == "nemotron_h" and card["pattern"] == backbone.hybrid_override_pattern
    assert {"M", "*", "E"} <= set(card["pattern"])
    with safe_open(str(NEMOTRON_H_TARGET / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert any(".mixer._fp32_params.A_log" in n for n in names) and any(n.endswith(".experts.gate_and_up_projs")
                                                                          for n in names)
    assert not any(n.startswith("llm.mtp.") for n in names)
    assert "mtp" not in json.loads((NEMOTRON_H_TARGET / "config.json").read_text())


@BOTH_TARGETS
def test_stored_target_transcribes_held_out_within_recorded_band(bench, held_out, target):
    train_reference_target, _ = bench
    card = json.loads((target / "card.json").read_text())
    result = train_reference_target.transcribe(target, held_out)
    assert result["samples"] == train_reference_target.PROBE_COUNT
    # Same audio, same float32 greedy decoding: the card's transcripts come back; allow one word of drift.
    assert [e["id"] for e in result["examples"]] == [e["id"] for e in card["probe"]]
    words = result["wer"]["reference_words"]
    assert abs(result["wer"]["wer"] - card["probe_wer"]) <= 1.0 / words + 1e-9
    assert result["wer"]["wer"] <= card["test_wer"] + 0.1  # the probe is representative of the recorded WER
    # The stored target transcribes (issue #7): most held-out words right, from an encoder that CTC stage 1 trained.
    assert card["test_wer"] <= 0.2
    assert card["encoder_pretraining"]["test_cer"] < 0.5


@BOTH_TARGETS
def test_stored_target_listens_to_the_audio(bench, held_out, tmp_path, target):
    """Silence of the same length must not give the same transcripts (a collapsed perception made the old
    target transcribe from the audio length alone)."""
    import gzip

    import numpy as np
    import soundfile as sf

    train_reference_target, _ = bench
    card = json.loads((target / "card.json").read_text())
    records = [json.loads(line) for line in gzip.open(held_out, "rt")]
    for record in records:
        recording = record["recording"]
        wav = tmp_path / f"{record['id']}.wav"
        sf.write(wav, np.zeros(recording["num_samples"], dtype=np.float32), recording["sampling_rate"])
        recording["sources"][0]["source"] = str(wav)
    silent = tmp_path / "silent_cuts.jsonl.gz"
    with gzip.open(silent, "wt") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    result = train_reference_target.transcribe(target, silent)
    assert result["samples"] == len(records) == train_reference_target.PROBE_COUNT
    hypotheses = [e["hypothesis"] for e in result["examples"]]
    assert sum(h != e["hypothesis"] for h, e in zip(hypotheses, card["probe"])) >= len(records) - 1
    assert result["wer"]["wer"] >= card["probe_wer"] + 0.3


def test_acceptance_benchmark_smallest_configuration_runs(bench, tmp_path):
    """Two seeds, a method row against its baseline, MTP at K = D and 2D: every seed's figures kept, the summary
    computed from them, the verdict from the summaries."""
    from dflash_train.testing.demo_data import varied_sentences, write_demo_data

    _, acceptance = bench
    train, test = write_demo_data(tmp_path / "data", 10, 2, jobs=1, sentences=varied_sentences(10))
    results = acceptance.run(
        TARGET, steps=2, label_limit=8, eval_limit=None, seeds=[0, 1], max_new_tokens=24,
        variants=["dflash", "dflash+kl", "mtp"], work=tmp_path / "work", cuts=(train, test),
    )
    assert results["K"] == 7 and results["failures"] == 0 and results["samples_evaluated"] == 2
    assert list(results["variants"]) == ["dflash", "dflash+kl", "mtp K=D", "mtp K=2D"]
    for row in results["variants"].values():
        assert row["steps"] == 2 and row["greedy_equal"] and list(row["per_seed"]) == ["0", "1"]
        mals = [seed_row["mal"] for seed_row in row["per_seed"].values()]
        assert row["mal"]["values"] == mals and row["mal"]["mean"] == pytest.approx(sum(mals) / 2)
        assert row["mal"]["sd"] == pytest.approx(abs(mals[0] - mals[1]) / 2 ** 0.5)
        for seed_row in row["per_seed"].values():
            accepted = [p["accepted"] for p in seed_row["per_position"]]  # position k is accepted after 1..k-1
            assert len(accepted) == row["K"] and all(later <= earlier for earlier, later in zip(accepted, accepted[1:]))
            assert accepted[0] <= seed_row["rounds"]
            assert seed_row["mal"] == pytest.approx(1 + sum(accepted) / seed_row["rounds"])
            assert seed_row["wer"] == results["target_wer"]  # greedy equality: speculative WER equals target-only
            assert 1.0 <= seed_row["mal"] <= seed_row["ceiling"] <= row["K"] + 1
            assert seed_row["fraction_of_ceiling"] == pytest.approx(seed_row["mal"] / seed_row["ceiling"])
    kl, base = results["variants"]["dflash+kl"], results["variants"]["dflash"]
    assert kl["overrides"] == ["dflash.loss_ce_weight=0", "dflash.loss_kl_weight=1"] and not base["overrides"]
    verdict = kl["versus"]
    assert verdict["baseline"] == "dflash" and "versus" not in base
    assert verdict["difference"] == pytest.approx(kl["mal"]["mean"] - base["mal"]["mean"])
    assert verdict["wins"] == (verdict["difference"] > 2 * verdict["standard_error"])
    lines = acceptance.table(results)
    assert [results["variants"][n]["K"] for n in ("mtp K=D", "mtp K=2D")] == [3, 6]
    assert lines[0].startswith("| variant |") and sum(line.startswith(("| dflash", "| mtp")) for line in lines) == 4
    assert (tmp_path / "work" / "results.json").exists()


def test_acceptance_benchmark_runs_on_the_nemotron_h_target(bench, tmp_path):
    """The Nemotron-H target's rows (Mamba state rolled back in the reference decoder, MTP heads trained and
    exported beside its native-named LLM): one seed, DFlash2, EAGLE-3 (also served at K = 3) and MTP, greedy
    equal, counters consistent."""
    from dflash_train.testing.demo_data import varied_sentences, write_demo_data

    _, acceptance = bench
    train, test = write_demo_data(tmp_path / "data", 10, 2, jobs=1, sentences=varied_sentences(10))
    results = acceptance.run(
        NEMOTRON_H_TARGET, steps=2, label_limit=8, eval_limit=None, seeds=[0], max_new_tokens=24,
        variants=["dflash2", "eagle3", "mtp"], work=tmp_path / "work", cuts=(train, test), eagle3_ks=(3,),
    )
    assert results["K"] == 7 and results["failures"] == 0 and results["samples_evaluated"] == 2
    assert list(results["variants"]) == ["dflash2", "eagle3", "mtp K=D", "mtp K=2D", "eagle3 K=3"]
    assert [results["variants"][n]["K"] for n in ("eagle3", "eagle3 K=3")] == [7, 3]
    for row in results["variants"].values():
        assert row["greedy_equal"] and list(row["per_seed"]) == ["0"]
        seed_row = row["per_seed"]["0"]
        accepted = [p["accepted"] for p in seed_row["per_position"]]
        assert seed_row["mal"] == pytest.approx(1 + sum(accepted) / seed_row["rounds"])
        assert seed_row["wer"] == results["target_wer"]


def test_a_method_wins_only_beyond_two_standard_errors(bench):
    """The verdict rule on figures written out: both means with SE 0.058, so 2 SE of the difference is 0.16: +0.30
    wins, +0.10 does not."""
    _, acceptance = bench

    def row(values):
        return {"mal": acceptance.summary(values)}

    base = row([5.9, 6.0, 6.1])  # sd 0.1, SE 0.0577
    assert acceptance.versus(row([6.2, 6.3, 6.4]), base, "dflash")["wins"]
    assert not acceptance.versus(row([6.0, 6.1, 6.2]), base, "dflash")["wins"]
    close = acceptance.versus(row([6.0, 6.1, 6.2]), base, "dflash")
    assert close["standard_error"] == pytest.approx((2 * 0.01 / 3) ** 0.5)
    assert close["per_seed_differences"] == pytest.approx([0.1, 0.1, 0.1])
    assert acceptance.baseline_of("dflash2+kl", ["dflash", "dflash2"]) == "dflash2"
    assert acceptance.baseline_of("dflash2-target_argmax", ["dflash2"]) is None


def test_the_ceiling_and_the_rounds_after_a_correction_on_replies_written_out(bench):
    """K = 7. A 19-token reply: 18 tokens after the prefill, rounds of 7 + 1, 7 + 1 and the 2 left, MAL 19 / 3;
    25 tokens: three full rounds, MAL 8. Rounds 3, 7, 2: the second starts after a correction (3 < K) and
    accepts 7; rounds 7, 7, 0, 0: only the last starts after a correction, accepting 0."""
    _, acceptance = bench
    assert acceptance.ceiling_mal([19], 7) == pytest.approx(19 / 3)
    assert acceptance.ceiling_mal([25], 7) == pytest.approx(8.0)
    assert acceptance.ceiling_mal([19, 25], 7) == pytest.approx((16 + 3 + 21 + 3) / 6)
    assert acceptance.after_correction_mal([[3, 7, 2]], 7) == pytest.approx(8.0)
    assert acceptance.after_correction_mal([[7, 7, 0, 0], [3, 7, 2]], 7) == pytest.approx(1 + 7 / 2)
    assert acceptance.after_correction_mal([[7, 7]], 7) is None
