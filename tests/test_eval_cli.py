"""The console commands on the tiny real SALM and synthesized speech: dflash-eval, dflash-labels, dflash-exposure."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import compose, load_salm_target, tiny_run_overrides
from lhotse import CutSet
from lhotse.utils import fastcopy

from dflash_train.cli import eval as eval_cli
from dflash_train.cli import exposure
from dflash_train.cli import labels as labels_cli
from dflash_train.config.schema import InputConfig
from dflash_train.data import exposure as exposure_estimate
from dflash_train.data.collate import collate_padded
from dflash_train.data.examples import Filters, Preparer
from dflash_train.data.inputs import open_input
from dflash_train.data.prompt import build_prompt_format
from dflash_train.draft import DraftSpec, build_draft, write_export
from dflash_train.evaluate import EvalReport, StopRule, TargetSession, greedy_decode, prompt_embeddings, read_requests
from dflash_train.evaluate.loading import default_stop_token_ids
from dflash_train.evaluate.offline_labels import ORIGINAL_TEXT, ORIGINAL_VALUE, relabel, sidecar_path

MAX_NEW = 12


def _export(target, out_dir, variant="dflash", taps=(1, 3)):
    from dflash_train.config import validate_config

    overrides = tiny_run_overrides("unused") + [f"dflash={variant}", "dflash.block_size=4"]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16", "dflash.selector_top_k=8"]
    spec = DraftSpec(validate_config(compose("dflash", overrides)).run.dflash, tuple(taps), 320, 6)
    torch.manual_seed(0)
    draft = build_draft(target.salm.llm.config, spec, "sdpa")
    return write_export(out_dir, draft.config, draft.state_dict())


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {v: _export(tiny_target, root / v, v) for v in ("dflash", "dflash2")}


@pytest.fixture
def cuts_copy(demo_data, tmp_path):
    """The demo validation cuts with their audio copied next to them (so one file can go missing)."""
    _, val = demo_data
    wav_dir = tmp_path / "wavs"
    wav_dir.mkdir()
    cuts = []
    for cut in CutSet.from_file(str(val)):
        source = cut.recording.sources[0]
        copy = shutil.copy(source.source, wav_dir)
        recording = fastcopy(cut.recording, sources=[fastcopy(source, source=str(copy))])
        cuts.append(fastcopy(cut, recording=recording))
    path = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(str(path))
    return path, [c.id for c in cuts], {c.id: c.recording.sources[0].source for c in cuts}


def _eval_args(target_dir, cuts, *extra):
    return ["--target", str(target_dir), "--cuts", str(cuts), "--max-new-tokens", str(MAX_NEW), "--device", "cpu",
            *extra]


def test_eval_compares_two_drafts_on_identical_samples(tiny_salm_dir, drafts, cuts_copy, tmp_path, capsys):
    cuts, ids, _ = cuts_copy
    code = eval_cli.main(_eval_args(tiny_salm_dir, cuts, "--draft", str(drafts["dflash2"]),
                                    "--baseline", str(drafts["dflash"]), "--json", str(tmp_path / "r.json")))
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["provisional"] is False and data["samples_expected"] == data["samples_evaluated"] == 4
    assert [s["id"] for s in data["samples"]] == ids
    assert data["settings"]["num_speculative_tokens"] == 3  # block_size - 1
    assert (data["settings"]["dtype"], data["settings"]["perception_dtype"]) == ("float32", "bfloat16")  # as served
    assert set(data["settings"]["stop_token_ids"]) >= {tiny_salm_token(tiny_salm_dir, "<|im_end|>")}
    for name in ("draft", "baseline"):
        result = data["drafts"][name]
        acceptance = result["acceptance"]
        rounds = [a for s in data["samples"] for a in s["drafts"][name]["accepted_per_round"]]
        assert acceptance["rounds"] == len(rounds) and acceptance["mal"] == 1 + sum(rounds) / len(rounds)
        assert result["greedy_equal"] and result["wer"] == data["target_only"]["wer"]
        assert len(acceptance["per_position"]) == 3
    assert data["target_only"]["wer"]["scored_samples"] == 4
    assert "MAL (pooled)" in out and "baseline" in out and (tmp_path / "r.png").stat().st_size > 0


def test_perception_runs_in_the_serving_precision(tiny_salm_dir, speech_batch):
    target = load_salm_target(tiny_salm_dir)
    audios, lens = speech_batch
    full = target.encode_audio(audios, lens)
    target.run_perception_in(torch.bfloat16)
    served = target.encode_audio(audios, lens)
    assert {p.dtype for p in target.salm.perception.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in target.salm.llm.parameters()} == {torch.float32}
    assert [f.dtype for f in served] == [torch.bfloat16] * len(full) and [f.shape for f in served] == [
        f.shape for f in full
    ]
    scale = max(f.abs().max().item() for f in full)
    errors = [(a.float() - b).abs().max().item() / scale for a, b in zip(served, full)]
    assert 0 < max(errors) < 0.05, errors  # bf16 rounding through the encoder: different, and close


def test_settings_without_perception_dtype_rerun_as_they_were_measured():
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import EvalSettings

    settings = EvalSettings(TargetSource(checkpoint="t"), {"draft": "d"}, InputConfig(cuts_path="c.jsonl.gz"), "qwen",
                            None, 3, 12, (2,), "float16", "cpu", perception_dtype="bfloat16")
    assert EvalSettings.from_dict(settings.to_dict()) == settings
    recorded_before = {k: v for k, v in settings.to_dict().items() if k != "perception_dtype"}
    assert EvalSettings.from_dict(recorded_before).perception_dtype == "float16"


def tiny_salm_token(salm_dir, token):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(salm_dir)).convert_tokens_to_ids(token)


def test_failed_sample_is_listed_then_rerun_under_the_same_settings(tiny_salm_dir, drafts, cuts_copy, tmp_path,
                                                                    capsys):
    cuts, ids, wavs = cuts_copy
    missing = ids[1]
    hidden = tmp_path / "hidden.wav"
    shutil.move(wavs[missing], hidden)
    report_path = tmp_path / "report.json"
    args = _eval_args(tiny_salm_dir, cuts, "--draft", str(drafts["dflash"]))
    assert eval_cli.main([*args, "--json", str(report_path)]) == eval_cli.EXIT_FAILED_SAMPLES
    first = json.loads(report_path.read_text())
    assert first["provisional"] is True and (first["samples_expected"], first["samples_evaluated"]) == (4, 3)
    assert [f["id"] for f in first["failures"]] == [missing] and "missing_audio" in first["failures"][0]["error"]
    assert "PROVISIONAL" in capsys.readouterr().out

    shutil.move(hidden, wavs[missing])
    assert eval_cli.main(["--rerun-failed", str(report_path), "--draft", "x"]) == eval_cli.EXIT_USAGE
    assert "--rerun-failed takes its settings from the report" in capsys.readouterr().err
    assert eval_cli.main(["--rerun-failed", str(report_path)]) == 0
    merged = EvalReport.read_json(report_path)
    assert not merged.provisional and [s.id for s in merged.samples] == ids

    assert eval_cli.main([*args, "--json", str(tmp_path / "clean.json")]) == 0
    clean = EvalReport.read_json(tmp_path / "clean.json")
    assert json.dumps(merged.counters("draft").to_dict()) == json.dumps(clean.counters("draft").to_dict())
    for got, want in zip(merged.samples, clean.samples):
        assert got.target.token_ids == want.target.token_ids
        assert got.drafts["draft"].accepted_per_round == want.drafts["draft"].accepted_per_round


def test_eval_errors_are_one_line(tiny_salm_dir, tiny_target, cuts_copy, tmp_path, capsys):
    cuts, _, _ = cuts_copy
    bad_taps = _export(tiny_target, tmp_path / "bad", taps=(1, 7))
    cases = [
        (_eval_args(tmp_path / "nowhere", cuts, "--draft", str(bad_taps)), "is not a SALM checkpoint directory"),
        (_eval_args(tiny_salm_dir, cuts, "--draft", str(bad_taps)), "target_layer_ids [7] outside the target's 6"),
        (_eval_args(tiny_salm_dir, cuts, "--draft", str(tmp_path)), "is not a draft export"),
        (_eval_args(tiny_salm_dir, cuts), "--draft (a draft export directory) or --mtp"),
        (_eval_args(tiny_salm_dir, cuts, "--mtp"), "has no mtp block with enabled: true"),
    ]
    for args, message in cases:
        assert eval_cli.main(args) == eval_cli.EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("module", [eval_cli, labels_cli, exposure])
def test_help_documents_every_option(module):
    parser = module.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
        for flag in action.option_strings:
            assert flag in text


def _greedy_replies(target, cuts, ids, rule):
    """Target-only greedy decoding of ``cuts`` through the library: what the labels must contain."""
    fmt = build_prompt_format("qwen", target.tokenizer, "<|audio|>")
    from dflash_train.data.estimator import AudioTokenEstimator
    from dflash_train.evaluate.requests import reply_text

    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts))
    out = {}
    for request in read_requests(inp, fmt, AudioTokenEstimator.from_target(target)):
        decoded = greedy_decode(TargetSession(target), prompt_embeddings(target, request.prompt), rule)
        out[request.id] = (decoded, reply_text(fmt, decoded))
    assert list(out) == ids
    return out


def test_labels_round_trip_keeps_ids_and_context_and_drops_failures(tiny_salm_dir, tiny_target, cuts_copy, tmp_path,
                                                                   capsys, audio_estimator):
    cuts, ids, wavs = cuts_copy
    fmt = build_prompt_format("qwen", tiny_target.tokenizer, "<|audio|>")
    eos_rule = StopRule(MAX_NEW, frozenset(default_stop_token_ids(fmt)))
    # the random tiny target never says <|im_end|>: stop on a token its first reply produces instead
    stop = _greedy_replies(tiny_target, cuts, ids, eos_rule)[ids[0]][0].token_ids[3]
    rule = StopRule(MAX_NEW, frozenset([stop]))
    expected = _greedy_replies(tiny_target, cuts, ids, rule)
    missing = ids[2]
    shutil.move(wavs[missing], tmp_path / "hidden.wav")

    out = tmp_path / "labelled" / "cuts.jsonl.gz"
    code = labels_cli.main(["--target", str(tiny_salm_dir), "--cuts", str(cuts), "--out", str(out), "--device", "cpu",
                            "--max-new-tokens", str(MAX_NEW), "--stop-token-id", str(stop)])
    assert code == 0, capsys.readouterr()
    sidecar = json.loads(sidecar_path(out).read_text())
    excluded = {e["id"]: e["reason"] for e in sidecar["excluded"]}
    assert excluded[missing] == "failed"
    stopped = [i for i in ids if i != missing and expected[i][0].finish_reason == "stop" and expected[i][1].strip()]
    truncated = [i for i in ids if i != missing and expected[i][0].finish_reason == "length"]
    assert ids[0] in stopped and sidecar["written"] == len(stopped)
    assert all(excluded[i] == "truncated" for i in truncated)
    assert sidecar["settings"]["target_checkpoint"] == str(tiny_salm_dir.resolve())
    assert sidecar["settings"]["stop_token_ids"] == [stop] and sidecar["settings"]["max_new_tokens"] == MAX_NEW

    original = {c.id: c for c in CutSet.from_file(str(cuts))}
    labelled = list(CutSet.from_file(str(out)))
    assert [c.id for c in labelled] == stopped
    for cut in labelled:
        before = original[cut.id]
        assert cut.recording.sources == before.recording.sources and cut.recording.id == before.recording.id
        assert (cut.start, cut.duration, cut.custom) == (before.start, before.duration, before.custom)
        assert cut.supervisions[0].text == expected[cut.id][1]
        assert cut.supervisions[0].custom[ORIGINAL_TEXT] == before.supervisions[0].text
    # training reads the file as it reads any cuts: the target's reply is the supervised turn, context kept
    source = open_input(InputConfig(type="lhotse_as_conversation", cuts_path=str(out)), None, 16000)
    prepare = Preparer(fmt, audio_estimator, Filters())
    for record in source.records:
        conversation = source.convert(record)
        turns = {t.role: t for t in conversation.turns if t.text is not None}
        assert turns["assistant"].supervised and turns["assistant"].text == expected[record.id][1]
        context = (original[record.id].custom or {}).get("context")
        assert context is None or turns["user"].text == context
        assert prepare(conversation).num_supervised > 0


def test_relabel_keeps_manifest_and_conversation_records_whole():
    from dflash_train.data.inputs import JsonRecord

    asr = JsonRecord("m.jsonl", 1, {"audio_filepath": "a.wav", "offset": 1.5, "duration": 2.0, "text": "old",
                                    "context": "Transcribe:"})
    new = relabel(InputConfig(type="lhotse_as_conversation", manifest_filepath="m.jsonl"), asr, "new words")
    assert new == {**asr.data, "text": "new words", ORIGINAL_TEXT: "old"}
    turns = [{"from": "User", "type": "audio", "value": "a.wav", "duration": 2.0},
             {"from": "Assistant", "type": "text", "value": "first"},
             {"from": "User", "type": "text", "value": "and?"},
             {"from": "Assistant", "type": "text", "value": "second"}]
    conv = JsonRecord("c.jsonl", 3, {"id": "c-1", "conversations": turns})
    new = relabel(InputConfig(type="multimodal_conversation", manifest_filepath="c.jsonl"), conv, "new")
    assert new["id"] == "c-1" and new["conversations"][:3] == turns[:3]
    assert new["conversations"][3] == {**turns[3], "value": "new", ORIGINAL_VALUE: "second"}
    assert conv.data["conversations"][3]["value"] == "second"  # the input record is untouched


def test_supervised_positions_match_the_real_splice(tiny_target, demo_data, audio_estimator):
    _, val = demo_data
    fmt = build_prompt_format("qwen", tiny_target.tokenizer, "<|audio|>")
    source = open_input(InputConfig(type="lhotse_as_conversation", cuts_path=str(val)), "Be brief.", 16000)
    prepare = Preparer(fmt, audio_estimator, Filters())
    examples = [prepare(source.convert(r)) for r in list(source.records)[:2]]
    batch = collate_padded(examples, tiny_target.pad_id, "x")
    spliced = tiny_target.splice_batch(batch, 320)
    for row, example in enumerate(examples):
        expected = spliced.loss_mask[row].nonzero().flatten().numpy()
        assert np.array_equal(exposure_estimate.supervised_positions(example, fmt.audio_locator_tag_id), expected)
        assert int(spliced.lengths[row]) == example.num_tokens


def _example(num_tokens, supervised, duration):
    """A text-only example: ``supervised`` positions at the end of ``num_tokens``."""
    from dflash_train.data.examples import Example

    mask = np.zeros(num_tokens, dtype=bool)
    mask[num_tokens - supervised:] = True
    return Example("x", np.zeros(num_tokens, dtype=np.int32), mask, [], [], num_tokens, supervised, duration)


def test_expected_anchors_follow_the_block_and_cap_rules():
    short, long = _example(20, 10, 2.0), _example(40, 30, 50.0)
    # padded: a block stays inside its own example (a <= len - 4): short 7 (positions 10..16), long 27 -> cap 16
    assert exposure_estimate.expected_anchors([short, long], -1, 4, 16, packed=False) == [7.0, 16.0]
    # packed: in-document a <= len - 4 -> 7 and 27 valid; 16 drawn from 34
    packed = exposure_estimate.expected_anchors([short, long], -1, 4, 16, packed=True)
    assert packed == pytest.approx([7 * 16 / 34, 27 * 16 / 34])
    estimate = exposure_estimate.estimate_exposure([[short, short], [short, long]], -1, 4, 16, False, 30.0)
    assert (estimate.batches, estimate.short_only_batches, estimate.long_examples) == (2, 1, 1)
    # 7 anchors per short example in either batch; the denominator keeps the short-only batch
    assert (estimate.anchors, estimate.long_anchors) == (7 + 7 + 7 + 16, 16)
    assert estimate.fraction == pytest.approx(16 / 37)


def test_exposure_command_runs_the_recipe_sampler(tiny_salm_dir, demo_data, tmp_path, capsys):
    train, _ = demo_data
    durations = sorted(c.duration for c in CutSet.from_file(str(train)))
    overrides = [o for o in tiny_run_overrides(tiny_salm_dir) if not o.startswith("data.train_ds.input_cfg")] + [
        f"data.train_ds.input_cfg=[{{type:lhotse_as_conversation,cuts_path:{train}}}]",
        "data.train_ds.batch_tokens=512", "data.train_ds.max_tokens=512", "data.train_ds.num_workers=0",
        "data.train_ds.bucket_estimate_samples=20", "dflash.block_size=4", "dflash.num_anchors=8",
    ]
    threshold = durations[len(durations) // 2]
    out = tmp_path / "exposure.json"
    assert exposure.main(["--config-name", "dflash", "--batches", "4", "--long-audio-seconds", str(threshold),
                          "--json", str(out), *overrides]) == 0
    data = json.loads(out.read_text())
    assert data["is_estimate"] and data["batches"] == 4 and 0 < data["estimated_long_anchor_fraction"] < 1
    assert data["anchors"] > 0 and "ESTIMATE" in capsys.readouterr().out
    assert exposure.main(["--config-name", "dflash", "--batches", "2", "--long-audio-seconds", "1000",
                          "--json", str(out), *overrides]) == 0
    assert json.loads(out.read_text())["estimated_long_anchor_fraction"] == 0.0


def test_eval_takes_target_prompt_and_data_from_a_user_recipe(tiny_salm_dir, drafts, demo_data, tmp_path, capsys):
    _, val = demo_data
    (tmp_path / "my_run.yaml").write_text(
        "defaults:\n  - dflash\n  - _self_\n"
        f"model:\n  pretrained_name: {tiny_salm_dir}\n"
        "data:\n  system_prompt: Answer briefly.\n  train_ds:\n    input_cfg: []\n"
        f"  validation_ds:\n    input_cfg:\n      - {{type: lhotse_as_conversation, cuts_path: {val}, name: dev}}\n"
    )
    report = tmp_path / "r.json"
    code = eval_cli.main(["--config-dir", str(tmp_path), "--config-name", "my_run", "--draft", str(drafts["dflash"]),
                          "--limit", "1", "--max-new-tokens", "4", "--device", "cpu", "--json", str(report),
                          "trainer.precision=32-true", "dflash.draft_num_hidden_layers=2"])
    assert code == 0, capsys.readouterr()
    settings = json.loads(report.read_text())["settings"]
    assert settings["data"]["cuts_path"] == str(val) and settings["system_prompt"] == "Answer briefly."
    assert settings["target"]["config_name"] == "my_run" and settings["prompt_format"] == "qwen"
