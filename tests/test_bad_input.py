"""Bad input never poisons a run or passes through (docs/data.md, Bad input; docs/evaluation.md).

Part 1: a cut whose audio holds NaN samples is skipped before sampling, so a run with it trains
exactly like the run without it. Part 2: the bad-input matrix: every CLI against every kind of
broken input file, each row asserting a non-zero exit, one line naming the file, no traceback
and no output written. A new CLI or input kind is a new row.
"""

import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import run_cli_rows, compose, same_tensors
from safetensors.torch import load_file

from dflash_train.config import validate_config
from dflash_train.training.recipe import train

BIN = Path(sys.executable).parent


def _records(cuts_path):
    with gzip.open(cuts_path, "rt") as handle:
        return [json.loads(line) for line in handle]


def _write_cuts(path, records):
    with gzip.open(path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _nan_record(template: dict, out_dir: Path) -> dict:
    """A copy of a demo cut whose audio file is float WAV with three NaN samples."""
    source = template["recording"]["sources"][0]["source"]
    samples, rate = sf.read(source, dtype="float32")
    samples[1000:1003] = np.nan
    wav = out_dir / "nan.wav"
    sf.write(str(wav), samples, rate, subtype="FLOAT")
    record = json.loads(json.dumps(template))
    record["id"] = record["supervisions"][0]["id"] = "nan-audio"
    record["recording"]["id"] = record["supervisions"][0]["recording_id"] = "nan-audio"
    record["recording"]["sources"][0]["source"] = str(wav)
    return record


def _demo_run(salm_dir, train_cuts, val_cuts, run_dir):
    overrides = [
        f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=24",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
        "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]
    return train(validate_config(compose("demo", overrides)))


def test_a_nan_audio_cut_is_skipped_and_the_run_equals_the_run_without_it(tiny_salm_dir, demo_data, tmp_path):
    train_cuts, val_cuts = demo_data
    good = _records(train_cuts)
    with_nan = good[:5] + [_nan_record(good[0], tmp_path)] + good[5:]
    clean = _demo_run(tiny_salm_dir, _write_cuts(tmp_path / "clean.jsonl.gz", good), val_cuts, tmp_path / "clean")
    poisoned = _demo_run(tiny_salm_dir, _write_cuts(tmp_path / "nan.jsonl.gz", with_nan), val_cuts, tmp_path / "nan")
    assert clean.steps == poisoned.steps == 3 and poisoned.export_dir is not None
    assert poisoned.skipped.get("nonfinite_audio") == 1 and not clean.skipped.get("nonfinite_audio")
    assert "skipped samples: nonfinite_audio 1" in poisoned.report(validate_config(
        compose("demo", [f"model.pretrained_name={tiny_salm_dir}"])).run)
    weights = load_file(str(poisoned.export_dir / "model.safetensors"))
    assert same_tensors(weights, load_file(str(clean.export_dir / "model.safetensors")))
    assert all(bool(np.isfinite(t.numpy()).all()) for t in weights.values())


# ---------------------------------------------------------------------------------------- the matrix
@pytest.fixture(scope="module")
def broken(tiny_salm_dir, tiny_target, demo_data, tmp_path_factory):
    """Good inputs and one broken input of each kind, built here."""
    from dflash_train.draft import DraftSpec, build_draft, write_export
    from dflash_train.variants import DFlashConfig

    root = tmp_path_factory.mktemp("broken")
    train_cuts, val_cuts = demo_data
    spec = DraftSpec(DFlashConfig(block_size=4, draft_num_hidden_layers=1), (1, 3), 320, tiny_target.num_layers)
    draft = write_export(root / "draft", build_draft(tiny_target.llm_config, spec, "sdpa").config,
                         build_draft(tiny_target.llm_config, spec, "sdpa").state_dict())
    paths = {"target": Path(tiny_salm_dir), "cuts": Path(val_cuts), "train": Path(train_cuts), "draft": draft}
    for name, source in (("truncated_target", paths["target"]), ("truncated_draft", draft)):
        shutil.copytree(source, root / name)
        weights = root / name / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        paths[name] = root / name
    (root / "not_json.jsonl").write_text("audio,text\nclip.wav,hello\n")
    paths["not_json"] = root / "not_json.jsonl"
    (root / "empty.jsonl.gz").write_bytes(b"")
    paths["empty"] = root / "empty.jsonl.gz"
    paths["missing"] = root / "no_such_cuts.jsonl.gz"
    (root / "a_file").write_text("a file where a directory is expected")
    paths["file"] = root / "a_file"
    paths["unwritable"] = root / "a_file" / "out"  # its parent is a regular file
    paths["nan"] = _write_cuts(root / "nan.jsonl.gz", [_nan_record(r, root) for r in _records(train_cuts)[:1]])
    return paths


def _out(tmp_path):
    return tmp_path / "output"


def _eval(p, tmp_path, **change):
    args = {"--target": p["target"], "--cuts": p["cuts"], "--draft": p["draft"], "--json": _out(tmp_path) / "r.json"}
    args.update(change)
    return ["--device", "cpu", "--max-new-tokens", "4", *[str(x) for kv in args.items() for x in kv]]


def _labels(p, tmp_path, **change):
    args = {"--target": p["target"], "--cuts": p["cuts"], "--out": _out(tmp_path) / "labels.jsonl.gz"}
    args.update(change)
    return ["--device", "cpu", "--max-new-tokens", "4", *[str(x) for kv in args.items() for x in kv]]


def _exposure(p, tmp_path, target=None, cuts=None, json_path=None):
    return ["--config-name", "demo", "--batches", "2", "--json", str(json_path or _out(tmp_path) / "e.json"),
            f"model.pretrained_name={target or p['target']}",
            f"data.train_ds.input_cfg.0.cuts_path={cuts or p['train']}",
            f"data.validation_ds.input_cfg.0.cuts_path={p['cuts']}"]


# (row id, command, argv builder, the file the one-line error must name)
IN_PROCESS = [
    ("eval/truncated target", "eval", lambda p, t: _eval(p, t, **{"--target": p["truncated_target"]}),
     lambda p: p["truncated_target"] / "model.safetensors"),
    ("eval/truncated draft", "eval", lambda p, t: _eval(p, t, **{"--draft": p["truncated_draft"]}),
     lambda p: p["truncated_draft"] / "model.safetensors"),
    ("eval/cuts not JSONL", "eval", lambda p, t: _eval(p, t, **{"--cuts": p["not_json"]}), lambda p: p["not_json"]),
    ("eval/missing cuts", "eval", lambda p, t: _eval(p, t, **{"--cuts": p["missing"]}), lambda p: p["missing"]),
    ("eval/empty cuts", "eval", lambda p, t: _eval(p, t, **{"--cuts": p["empty"]}), lambda p: p["empty"]),
    ("eval/target is a file", "eval", lambda p, t: _eval(p, t, **{"--target": p["file"]}), lambda p: p["file"]),
    ("eval/draft is a file", "eval", lambda p, t: _eval(p, t, **{"--draft": p["file"]}), lambda p: p["file"]),
    ("eval/unwritable report", "eval", lambda p, t: _eval(p, t, **{"--json": p["unwritable"]}),
     lambda p: p["unwritable"]),
    ("labels/truncated target", "labels", lambda p, t: _labels(p, t, **{"--target": p["truncated_target"]}),
     lambda p: p["truncated_target"] / "model.safetensors"),
    ("labels/cuts not JSONL", "labels", lambda p, t: _labels(p, t, **{"--cuts": p["not_json"]}),
     lambda p: p["not_json"]),
    ("labels/missing cuts", "labels", lambda p, t: _labels(p, t, **{"--cuts": p["missing"]}), lambda p: p["missing"]),
    ("labels/empty cuts", "labels", lambda p, t: _labels(p, t, **{"--cuts": p["empty"]}), lambda p: p["empty"]),
    ("labels/target is a file", "labels", lambda p, t: _labels(p, t, **{"--target": p["file"]}),
     lambda p: p["file"]),
    ("labels/unwritable output", "labels", lambda p, t: _labels(p, t, **{"--out": p["unwritable"]}),
     lambda p: p["unwritable"]),
    ("exposure/truncated target", "exposure", lambda p, t: _exposure(p, t, target=p["truncated_target"]),
     lambda p: p["truncated_target"] / "model.safetensors"),
    ("exposure/cuts not JSONL", "exposure", lambda p, t: _exposure(p, t, cuts=p["not_json"]),
     lambda p: p["not_json"]),
    ("exposure/missing cuts", "exposure", lambda p, t: _exposure(p, t, cuts=p["missing"]), lambda p: p["missing"]),
    ("exposure/empty cuts", "exposure", lambda p, t: _exposure(p, t, cuts=p["empty"]), lambda p: p["empty"]),
    ("exposure/unwritable estimate", "exposure", lambda p, t: _exposure(p, t, json_path=p["unwritable"]),
     lambda p: p["unwritable"]),
    ("export-target/truncated source", "export_target", lambda p, t: [str(p["truncated_target"]), str(_out(t))],
     lambda p: p["truncated_target"] / "model.safetensors"),
    ("export-target/source is a file", "export_target", lambda p, t: [str(p["file"]), str(_out(t))],
     lambda p: p["file"]),
    ("export-target/unwritable output", "export_target", lambda p, t: [str(p["target"]), str(p["unwritable"])],
     lambda p: p["unwritable"]),
    ("export-target/output is a file", "export_target", lambda p, t: [str(p["target"]), str(p["file"])],
     lambda p: p["file"]),
    ("export-target/truncated --draft config", "export_target",
     lambda p, t: [str(p["target"]), str(_out(t)), "--draft", str(p["not_json"])], lambda p: p["not_json"]),
]


@pytest.mark.parametrize("row, command, argv, named", IN_PROCESS, ids=[r[0] for r in IN_PROCESS])
def test_every_cli_fails_cleanly_on_each_broken_input(broken, tmp_path, capsys, row, command, argv, named):
    import importlib

    main = importlib.import_module(f"dflash_train.cli.{command}").main
    file_before = broken["file"].read_text()
    code = main(argv(broken, tmp_path))  # an unexpected exception would fail the test with its traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0, f"{row}: exit 0"
    prog = "dflash-" + command.replace("_", "-")
    assert err and err[-1].startswith(f"{prog}: error: ") and str(named(broken)) in err[-1], f"{row}: {err[-1:]}"
    assert not any("Traceback" in line for line in err)
    assert not _out(tmp_path).exists(), f"{row}: wrote output"
    assert broken["file"].read_text() == file_before  # a file in the way is never replaced


def test_debug_shows_the_traceback(broken, tmp_path):
    from dflash_train.cli import export_target
    from dflash_train.errors import InputFileError

    with pytest.raises(InputFileError):
        export_target.main([str(broken["truncated_target"]), str(_out(tmp_path)), "--debug"])


def test_export_target_in_place_keeps_the_weights_and_every_other_file(broken, tmp_path):
    from dflash_train.cli import export_target

    src = tmp_path / "ckpt"
    shutil.copytree(broken["target"], src)
    (src / "NOTES.txt").write_text("kept")
    weights = (src / "model.safetensors").read_bytes()
    assert export_target.main([str(src), str(src)]) == 0
    assert (src / "model.safetensors").read_bytes() == weights and (src / "NOTES.txt").read_text() == "kept"
    assert json.loads((src / "config.json").read_text())["pretrained_llm"] == str(src.resolve() / "llm_backbone")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")], "a staging directory was left"


# dflash-train through its real entry point (Hydra): every row in one driver process (tests/train_cli_rows.py)
TRAIN = [
    ("train/truncated target", lambda p: {"model.pretrained_name": p["truncated_target"]},
     lambda p: p["truncated_target"] / "model.safetensors"),
    ("train/target is a file", lambda p: {"model.pretrained_name": p["file"]}, lambda p: p["file"]),
    ("train/truncated warm-start export", lambda p: {"dflash.init_from_pretrained": p["truncated_draft"]},
     lambda p: p["truncated_draft"] / "model.safetensors"),
    ("train/cuts not JSONL", lambda p: {"data.train_ds.input_cfg.0.cuts_path": p["not_json"]}, lambda p: p["not_json"]),
    ("train/missing cuts", lambda p: {"data.train_ds.input_cfg.0.cuts_path": p["missing"]}, lambda p: p["missing"]),
    ("train/empty cuts", lambda p: {"data.train_ds.input_cfg.0.cuts_path": p["empty"]}, lambda p: p["empty"]),
    ("train/only NaN audio", lambda p: {"data.train_ds.input_cfg.0.cuts_path": p["nan"]}, lambda p: p["nan"]),
    ("train/unwritable run directory", lambda p: {"exp_manager.explicit_log_dir": p["unwritable"]},
     lambda p: p["unwritable"]),
]


def _row_dir(root: Path, row: str) -> Path:
    return root / row.replace("/", "_").replace(" ", "_")


@pytest.fixture(scope="module")
def train_rows(broken, tmp_path_factory) -> tuple[Path, dict]:
    """Every TRAIN row through dflash-train's entry point, in one driver process: ``(root, results by row)``."""
    root = tmp_path_factory.mktemp("train_rows")
    rows = []
    for row, change, _ in TRAIN:
        settings = {
            "model.pretrained_name": broken["target"],
            "data.train_ds.input_cfg.0.cuts_path": broken["train"],
            "data.validation_ds.input_cfg.0.cuts_path": broken["cuts"],
            "exp_manager.explicit_log_dir": _out(_row_dir(root, row)),
            "exp_manager.exp_dir": _row_dir(root, row) / "exp",
            **change(broken),
        }
        rows.append([row, ["--config-name=demo", "trainer.max_steps=1", *[f"{k}={v}" for k, v in settings.items()]]])
    return root, run_cli_rows(root, rows)


@pytest.mark.parametrize("row, change, named", TRAIN, ids=[r[0] for r in TRAIN])
def test_dflash_train_fails_cleanly_on_each_broken_input(broken, train_rows, row, change, named):
    root, results = train_rows
    code, stderr = results[row]["code"], results[row]["stderr"]
    err = stderr.strip().splitlines()
    assert code != 0, f"{row}: exit 0"
    assert err and "error: " in err[-1] and str(named(broken)) in err[-1], f"{row}: {err[-3:]}"
    assert "Traceback" not in stderr
    out = _out(_row_dir(root, row))
    assert not out.exists() or not any(out.rglob("*.safetensors")), f"{row}: wrote an export"


def test_export_target_never_replaces_a_directory_it_did_not_write(broken, tmp_path):
    from dflash_train.cli import export_target

    foreign = tmp_path / "serve"
    foreign.mkdir()
    (foreign / "model_card.md").write_text("someone else's")
    assert export_target.main([str(broken["target"]), str(foreign)]) == 2
    assert [p.name for p in foreign.iterdir()] == ["model_card.md"]
    fresh = tmp_path / "fresh"
    assert export_target.main([str(broken["target"]), str(fresh)]) == 0
    assert export_target.main([str(broken["target"]), str(fresh)]) == 0  # its own earlier export is replaced
