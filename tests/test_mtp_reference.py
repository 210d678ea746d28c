"""The reference decoder's MTP path without vLLM: NeMo-layout checkpoints, the MTP step, its proposer.

Checkpoints are tiny Nemotron-H SpeechLMs from :mod:`dflash_train.testing.tiny_mtp_salm`; the
target is read from their files (:class:`~dflash_train.target.nemotron_h.NemotronHSpeechLMTarget`).
Parity of all of this with vLLM itself is ``tests/vllm_serving/test_mtp.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.config.schema import InputConfig
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.prompt import build_prompt_format
from dflash_train.draft.mtp import MTPStep
from dflash_train.errors import ConfigError
from dflash_train.evaluate.decoder import MTPProposer, StopRule, greedy_decode, speculative_decode
from dflash_train.evaluate.loading import default_stop_token_ids
from dflash_train.evaluate.requests import prompt_embeddings, read_requests
from dflash_train.evaluate.session import TargetSession
from dflash_train.target.nemotron_h import NemotronHSpeechLMTarget
from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm

K = 3
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    specs = {
        "weak_echo": TinyMTPSpec(backbone_pattern="****", echo=True, echo_attention_std=0.1),
        "echo": TinyMTPSpec(backbone_pattern="****", echo=True),
        "distinct": TinyMTPSpec(backbone_pattern="****", distinct=True),
    }
    return {name: build_tiny_mtp_salm(root / name, spec) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def target(checkpoints):
    return NemotronHSpeechLMTarget.from_checkpoint(checkpoints["weak_echo"])


@pytest.fixture(scope="module")
def requests(target, demo_data):
    fmt = build_prompt_format("qwen", target.tokenizer, "<|audio|>")
    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(demo_data[1]))
    found = list(read_requests(inp, fmt, AudioTokenEstimator.from_target(target)))
    assert len(found) == 4 and all(hasattr(r, "prompt") for r in found)
    rule = StopRule(MAX_NEW, frozenset(default_stop_token_ids(fmt)))
    return [prompt_embeddings(target, r.prompt) for r in found], rule


def test_the_step_loads_nemos_layout_and_its_head_count(checkpoints):
    from safetensors.torch import load_file

    step, heads = MTPStep.from_checkpoint(checkpoints["weak_echo"])
    weights = load_file(str(checkpoints["weak_echo"] / "model.safetensors"))
    assert heads == 2 and step.pattern == "*"
    assert torch.equal(step.eh_proj.weight, weights["llm.mtp.layers.0.eh_proj.weight"])
    assert torch.equal(step.layers[0].q_proj.weight, weights["llm.mtp.layers.0.mixer.q_proj.weight"])
    assert torch.equal(step.final_layernorm.weight, weights["llm.mtp.layers.0.final_layernorm.weight"])


def test_checkpoints_the_route_cannot_serve_are_one_line_errors(checkpoints, tiny_salm_dir, tmp_path):
    with pytest.raises(ConfigError, match="distinct heads.*use_repeated_layer: true"):
        MTPStep.from_checkpoint(checkpoints["distinct"])
    with pytest.raises(ConfigError, match="no mtp block with enabled: true"):
        MTPStep.from_checkpoint(tiny_salm_dir)
    import shutil

    broken = tmp_path / "moe"
    shutil.copytree(checkpoints["echo"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["mtp"]["hybrid_override_pattern"] = "*E"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"hybrid_override_pattern='\*E'"):
        MTPStep.from_checkpoint(broken)


def test_a_target_whose_weights_do_not_match_its_config_is_refused(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "short"
    shutil.copytree(checkpoints["echo"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["llm.model.layers.3.mixer.o_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"llm\.\* weights do not match.*model\.layers\.3\.mixer\.o_proj"):
        NemotronHSpeechLMTarget.from_checkpoint(broken)


def test_an_echo_head_proposes_the_token_it_was_given(checkpoints, requests):
    echo_target = NemotronHSpeechLMTarget.from_checkpoint(checkpoints["echo"])
    step, _ = MTPStep.from_checkpoint(checkpoints["echo"])
    embeds, rule = requests
    for prompt in embeds:
        proposer = Recording(step, echo_target, K)
        speculative_decode(TargetSession(echo_target), proposer, prompt, rule)
        assert proposer.rounds and all(drafts == [bonus] * K for bonus, _, drafts in proposer.rounds)


class Recording(MTPProposer):
    """The real proposer, keeping every round's bonus position and proposals."""

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        super().start(prompt_embeds, prefill)
        self.rounds = []

    def propose(self, bonus, position):
        drafts = super().propose(bonus, position)
        self.rounds.append((bonus, position, drafts))
        return drafts


class RecomputingProposer(Recording):
    """The same step without keeping entries between rounds: every round recomputes every verified entry
    from the embeddings and hidden states it collected itself."""

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        super().start(prompt_embeds, prefill)
        self.all_hidden, self.all_next = prefill.hidden, prompt_embeds[0, 1:]

    def propose(self, bonus, position):
        assert self.all_hidden.shape[0] == position, "one entry per verified position"
        self._cache, self._hidden, self._next_embeds = self.step.new_cache(), self.all_hidden, self.all_next
        return super().propose(bonus, position)

    def extend(self, token_ids, verified):
        self.all_next = torch.cat([self.all_next, self._embed(token_ids)])
        self.all_hidden = torch.cat([self.all_hidden, verified.hidden])


def test_the_proposer_keeps_exactly_the_verified_entries(checkpoints, target, requests):
    """The cached proposer proposes what recomputing every entry from scratch proposes, round for round
    (a head accepted sometimes, whose proposals depend on its context entries)."""
    step, _ = MTPStep.from_checkpoint(checkpoints["weak_echo"])
    embeds, rule = requests
    accepted = 0
    for prompt in embeds:
        greedy = greedy_decode(TargetSession(target), prompt, rule)
        cached, recomputing = Recording(step, target, K), RecomputingProposer(step, target, K)
        out = speculative_decode(TargetSession(target), cached, prompt, rule)
        again = speculative_decode(TargetSession(target), recomputing, prompt, rule)
        assert out.token_ids == greedy.token_ids == again.token_ids
        assert cached.rounds == recomputing.rounds and len(cached.rounds) > 1
        accepted += sum(out.accepted_per_round)
    assert accepted > 0, "with no accepted proposal the verified entries would never grow past the bonus"


class EntryRecorder(MTPProposer):
    """The real proposer, keeping the (next-token embeddings, hidden states) of each round's first pass.

    With ``oracle`` (the target's greedy output) it returns the true continuation instead of its own
    proposals, after computing them: long rounds of different accepted tokens, bookkept as usual.
    """

    def __init__(self, step, target, k, oracle=None):
        super().__init__(step, target, k)
        self.oracle = oracle

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        super().start(prompt_embeds, prefill)
        self.first_pass, self.prompt_length = [], prompt_embeds.shape[1]

    def propose(self, bonus, position):
        step_forward, calls = self.step.forward, []

        def spy(embeds, hidden, cache=None):
            calls.append((embeds.clone(), hidden.clone()))
            return step_forward(embeds, hidden, cache)

        self.step.forward = spy
        try:
            drafts = super().propose(bonus, position)
        finally:
            del self.step.forward
        self.first_pass.append(calls[0])
        if self.oracle is None:
            return drafts
        after = self.oracle[position - self.prompt_length + 1 :]
        return (after + [0] * self.num_speculative_tokens)[: self.num_speculative_tokens]


def test_every_entry_reads_the_next_tokens_embedding_and_this_positions_target_state(checkpoints, target, requests):
    """Entry *j* is made of embedding *j + 1* (audio frames included) and the target's hidden state at *j*,
    whatever the rounds: checked against one teacher-forced target pass over the final sequence."""
    step, _ = MTPStep.from_checkpoint(checkpoints["weak_echo"])
    embeds, rule = requests
    runs = []
    for prompt in embeds:
        greedy = greedy_decode(TargetSession(target), prompt, rule).token_ids
        runs += [(prompt, EntryRecorder(step, target, K)), (prompt, EntryRecorder(step, target, K, oracle=greedy))]
    for prompt, proposer in runs:
        out = speculative_decode(TargetSession(target), proposer, prompt, rule)
        sequence = torch.cat([prompt[0], target.embed_tokens(torch.tensor(out.token_ids))])
        entry_embeds = torch.cat([e for e, _ in proposer.first_pass])
        entry_hidden = torch.cat([h for _, h in proposer.first_pass])
        n = entry_embeds.shape[0]
        assert n == prompt.shape[1] + sum(a + 1 for a in out.accepted_per_round[:-1]), "one entry per verified position"
        assert torch.equal(entry_embeds, sequence[1 : n + 1])
        teacher_forced = TargetSession(target).prefill(sequence[None]).hidden
        torch.testing.assert_close(entry_hidden, teacher_forced[:n], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_with_heads(tmp_path_factory):
    spec = TinyMTPSpec(backbone="qwen3", echo=True, echo_attention_std=0.1)
    return build_tiny_mtp_salm(tmp_path_factory.mktemp("qwen3_mtp") / "target", spec)


def test_a_salm_with_heads_beside_it_loads_strictly_but_the_heads(qwen3_with_heads, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_train.config.schema import ModelConfig
    from dflash_train.target.salm import TargetLoadError, load_salm

    salm = load_salm(ModelConfig(pretrained_name=str(qwen3_with_heads)))
    assert not [k for k in salm.state_dict() if "mtp" in k]
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_with_heads, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["llm.model.norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(TargetLoadError, match=r"missing \['llm.model.norm.weight'\]"):
        load_salm(ModelConfig(pretrained_name=str(broken)))


def test_mtp_heads_beside_a_salm_decode_to_its_greedy_output(qwen3_with_heads, demo_data):
    from dflash_train.config.schema import ModelConfig
    from dflash_train.evaluate.loading import load_mtp_heads, load_target

    salm_target = load_target(ModelConfig(pretrained_name=str(qwen3_with_heads)), "cpu", "float32", "bfloat16")
    step, heads = load_mtp_heads(str(qwen3_with_heads), salm_target, "cpu", "float32")
    fmt = build_prompt_format("qwen", salm_target.tokenizer, "<|audio|>")
    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(demo_data[1]))
    found = list(read_requests(inp, fmt, AudioTokenEstimator.from_target(salm_target)))
    rule = StopRule(MAX_NEW, frozenset(default_stop_token_ids(fmt)))
    accepted = 0
    for request in found:
        prompt = prompt_embeddings(salm_target, request.prompt)
        greedy = greedy_decode(TargetSession(salm_target), prompt, rule)
        out = speculative_decode(TargetSession(salm_target), MTPProposer(step, salm_target, K), prompt, rule)
        assert out.token_ids == greedy.token_ids
        accepted += sum(out.accepted_per_round)
    assert heads == 2 and accepted > 0


def test_the_builder_command_writes_the_requested_layout(tmp_path):
    from safetensors import safe_open

    from dflash_train.testing.tiny_mtp_salm import main

    assert main(["--out", str(tmp_path / "d"), "--heads", "3", "--distinct", "--backbone-pattern", "**"]) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["mtp"] == {"enabled": True, "num_nextn_predict_layers": 3, "use_repeated_layer": False,
                             "hybrid_override_pattern": "*"}
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        steps = {k.split(".")[3] for k in f.keys() if k.startswith("llm.mtp.layers.")}
        blocks = {k.split(".")[3] for k in f.keys() if k.startswith("llm.model.layers.")}
    assert steps == {"0", "1", "2"} and blocks == {"0", "1"}
