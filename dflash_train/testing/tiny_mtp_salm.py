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

The sizes are :mod:`~dflash_train.testing.tiny_salm`'s options (``--hidden-size``, ``--attention-heads``,
``--vocab``, ...; ``--layers`` only with ``--backbone qwen3``: a Nemotron-H backbone has one block per pattern
character), plus ``--mamba-heads``/``--mamba-head-dim`` and ``--experts``/``--experts-per-token`` for ``M``
and ``E`` blocks; ``--help`` lists every option with its default.

``--preset lightning`` starts from :data:`LIGHTNING`: Nemotron 3.5 Lightning's structure at tiny width (52 blocks,
23 Mamba-2, 23 MoE, 6 attention; top-6 routing plus a shared expert; 2 KV heads; MTP heads; the
``nemotron-nano-v3`` prompt format; encoder chunking); any other option still overrides it.

``--heads N`` sets ``mtp.num_nextn_predict_layers``; the default stores one MTP step
(``use_repeated_layer: true``, the layer the trainer applied N times), ``--distinct`` stores N
separate steps (``use_repeated_layer: false``), which the plugin refuses to serve. ``--echo``
builds a head that proposes the last token it was given (its acceptance is computable from
target-only output), by tying the embedding to the LM head and passing the token embedding
straight through the MTP step; ``--echo-attention-std S`` lets its attention and hidden-state
input act with weights of scale S (proposals then depend on the whole MTP computation).

    python -m dflash_train.testing.tiny_mtp_salm --out DIR [--preset lightning] [--heads N] [--distinct] [--echo [--echo-attention-std S]]
        [--backbone-pattern M*-E] [--hidden-size H] [--experts E] ...
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from dflash_train.constants import AUDIO_LOCATOR_TAG, CONFIG_FILE, LLM_BACKBONE_DIR, SALM_ARCHITECTURE, WEIGHTS_FILE
from dflash_train.target.vllm_export import EMBEDDED_ASR
from dflash_train.testing.tiny_salm import (
    DefaultsHelp,
    OneLineErrors,
    ShapeError,
    TinySALMSpec,
    _train_tokenizer,
    add_shape_arguments,
    positive,
    shape_from_arguments,
    tiny_perception_config,
)

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
    mamba_num_heads: int = 4  # an M block's heads, each mamba_head_dim wide
    mamba_head_dim: int = 16
    n_routed_experts: int = 4  # an E block's routed experts, num_experts_per_tok of them per token
    num_experts_per_tok: int = 2
    prompt_format: str = "qwen"  # config.json's prompt_format (NeMo's spelling)
    encoder_chunk_size_seconds: float | None = None  # config.json's: the encoder runs on chunks this long
    sizes: TinySALMSpec = TinySALMSpec()

    def check(self) -> None:
        """A :class:`~dflash_train.testing.tiny_salm.ShapeError` for a pattern or expert count the builder cannot
        write."""
        if self.backbone == "nemotron_h" and (not self.backbone_pattern or set(self.backbone_pattern) - set("M*-E")):
            raise ShapeError(f"backbone pattern {self.backbone_pattern!r}: Nemotron-H blocks are M, *, - and E")
        if not self.mtp_pattern or set(self.mtp_pattern) - {"*"}:
            raise ShapeError(f"MTP pattern {self.mtp_pattern!r}: the tiny builder writes attention ('*') MTP sublayers")
        if self.encoder_chunk_size_seconds is not None and self.encoder_chunk_size_seconds <= 0:
            raise ShapeError(f"encoder chunks of {self.encoder_chunk_size_seconds} s: a chunk lasts more than 0 s")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ShapeError(f"{self.num_experts_per_tok} experts per token out of {self.n_routed_experts}: "
                             "route each token to 1 to all of them")


LIGHTNING_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
"""52 blocks: 23 Mamba-2, 23 MoE, 6 attention (at 5, 12, 19, 26, 33, 42). Nemotron 3.5 Lightning's kinds and
counts; the order is Nemotron-3-Nano-30B-A3B's published ``hybrid_override_pattern`` (same architecture per
NVIDIA), since Lightning's own string is not public: modeled, not confirmed."""

LIGHTNING_TAPS = (1, 5, 19, 29, 41, 51)
"""The runbook's (NeMo's recipe's) ``dflash.target_layer_ids`` for a Lightning target."""

LIGHTNING = TinyMTPSpec(
    backbone_pattern=LIGHTNING_PATTERN,
    native_names=True,  # SALMAutomodel's checkpoint names, as the runbook's targets are stored
    n_routed_experts=8,  # Lightning: 128 routed experts, top-6, one shared expert (n_shared_experts=1)
    num_experts_per_tok=6,
    prompt_format="nemotron-nano-v3",
    encoder_chunk_size_seconds=1.0,  # Lightning: 30 s; 1 s splits the demo's 1-4 s utterances into chunks
    weight_std=0.1,  # through 52 blocks 0.28 (and 0.05) make greedy output one token repeated; 0.1 does not
    sizes=TinySALMSpec(num_attention_heads=8, num_key_value_heads=2),  # Lightning: GQA 32 query / 2 KV heads
)
"""Nemotron 3.5 Lightning's structure at tiny width (``--preset lightning``); hidden 64, a 4-head Mamba mixer."""

PRESETS = {"lightning": LIGHTNING}


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
        mamba_num_heads=spec.mamba_num_heads,
        mamba_head_dim=spec.mamba_head_dim,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=64,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
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
        else:  # E (TinyMTPSpec.check): MoE, HF's shapes, random weights large enough that routing and experts matter
            mixer = f"model.layers.{i}.mixer."
            for name, tensor in hf_init.items():
                if name.startswith(mixer):
                    bias = name.endswith("e_score_correction_bias")
                    weights[f"llm.{name}"] = torch.zeros(tensor.shape) if bias else rand(*tensor.shape)
    return weights


def _mtp_weights(spec: TinyMTPSpec, generator) -> dict:
    """``llm.mtp.layers.<j>.*`` in NeMo's layout: one module per pattern character per stored step.

    The first sublayer of a step fuses ``eh_proj(cat[enorm(embedding), hnorm(hidden)])`` (the
    embedding half first); the last ends with ``final_layernorm``.
    """
    import torch

    s = spec.sizes
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim

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
        raise ShapeError(f"heads={spec.heads}: a SpeechLM has zero or more MTP heads")
    spec.check()
    out_dir = Path(out_dir).resolve()
    if spec.backbone == "qwen3":
        if spec.heads < 1 or tokenizer_corpus is not None:
            raise ShapeError("the qwen3 backbone is the demo's target with MTP heads beside it: heads >= 1, "
                             "its own tokenizer")
        return _qwen3_salm_with_heads(out_dir, spec)
    if spec.backbone != "nemotron_h":
        raise ShapeError(f"backbone={spec.backbone!r}: the tiny builder writes nemotron_h or qwen3")
    tok = _train_tokenizer(out_dir, spec.sizes.tokenizer_vocab, tokenizer_corpus)
    (out_dir / LLM_BACKBONE_DIR).mkdir(parents=True, exist_ok=True)
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
        "prompt_format": spec.prompt_format,
        "perception": perception_config,
        **({"encoder_chunk_size_seconds": spec.encoder_chunk_size_seconds}
           if spec.encoder_chunk_size_seconds is not None else {}),
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
    """Command line: write one tiny MTP SpeechLM of the shape asked, print where and how to use it."""
    parser = OneLineErrors(
        prog="python -m dflash_train.testing.tiny_mtp_salm",
        description=__doc__.splitlines()[0],
        epilog="Train against it with model.pretrained_name=DIR; evaluate its heads with dflash-eval --target DIR "
        "--mtp (docs/target.md, \"A target of your own shape for a smoke run\").",
        formatter_class=DefaultsHelp,
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="start from a real target's structure at tiny width (lightning: Nemotron 3.5 Lightning, "
                             f"blocks {LIGHTNING_PATTERN}); the defaults shown are without a preset")
    parser.add_argument("--heads", type=int, metavar="N", default=TinyMTPSpec.heads,
                        help="MTP heads, mtp.num_nextn_predict_layers (0: none)")
    parser.add_argument("--distinct", action="store_true", help="store separate steps (use_repeated_layer: false)")
    parser.add_argument("--echo", action="store_true", help="a head that proposes its input token")
    parser.add_argument("--echo-attention-std", type=float, metavar="S", default=TinyMTPSpec.echo_attention_std,
                        help="with --echo: weak attention and hidden-state input")
    parser.add_argument("--mtp-pattern", default=TinyMTPSpec.mtp_pattern, help="one MTP step's sublayers ('*' each)")
    parser.add_argument(
        "--backbone",
        default=TinyMTPSpec.backbone,
        choices=["nemotron_h", "qwen3"],
        help="nemotron_h (NeMo's SpeechLM MTP layout) or qwen3 (a NeMo SALM, the demo's kind of target)",
    )
    parser.add_argument(
        "--backbone-pattern",
        default=TinyMTPSpec.backbone_pattern,
        help="Nemotron-H blocks, one per character: M (Mamba-2), * (attention), - (MLP), E (MoE)",
    )
    parser.add_argument("--native-names", action="store_true", help="SALMAutomodel's native names (nemo_automodel)")
    parser.add_argument("--prompt-format", default=TinyMTPSpec.prompt_format, help="config.json's prompt_format")
    parser.add_argument("--encoder-chunk-seconds", type=float, metavar="S",
                        default=TinyMTPSpec.encoder_chunk_size_seconds,
                        help="config.json's encoder_chunk_size_seconds (none: the encoder sees each audio whole)")
    add_shape_arguments(parser, depth_from_pattern=True)
    blocks = parser.add_argument_group("Nemotron-H blocks (--backbone nemotron_h)")
    blocks.add_argument("--mamba-heads", type=positive, metavar="N", default=TinyMTPSpec.mamba_num_heads,
                        help="an M block's heads")
    blocks.add_argument("--mamba-head-dim", type=positive, metavar="N", default=TinyMTPSpec.mamba_head_dim,
                        help="width of an M block's head")
    blocks.add_argument("--experts", type=positive, metavar="N", default=TinyMTPSpec.n_routed_experts,
                        help="an E block's routed experts")
    blocks.add_argument("--experts-per-token", type=positive, metavar="N", default=TinyMTPSpec.num_experts_per_tok,
                        help="routed experts each token goes to")
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**_preset_defaults(PRESETS[preset]))
    args = parser.parse_args(argv)
    if args.backbone == "nemotron_h" and args.layers is not None:
        parser.error(f"--layers {args.layers} is for --backbone qwen3: a Nemotron-H backbone has one block per "
                     f"--backbone-pattern character ({args.backbone_pattern!r})")
    if args.backbone == "nemotron_h" and args.tie_word_embeddings:
        parser.error("--tie-word-embeddings is for --backbone qwen3: the Nemotron-H builder stores the embedding "
                     "and the LM head apart")
    spec = replace(  # what no option sets (the layer weights' scale) comes from the preset
        PRESETS[args.preset] if args.preset else TinyMTPSpec(),
        heads=args.heads,
        distinct=args.distinct,
        echo=args.echo,
        echo_attention_std=args.echo_attention_std,
        mtp_pattern=args.mtp_pattern,
        backbone=args.backbone,
        backbone_pattern=args.backbone_pattern,
        native_names=args.native_names,
        mamba_num_heads=args.mamba_heads,
        mamba_head_dim=args.mamba_head_dim,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.experts_per_token,
        prompt_format=args.prompt_format,
        encoder_chunk_size_seconds=args.encoder_chunk_seconds,
        sizes=shape_from_arguments(parser, args),
    )
    try:
        out = build_tiny_mtp_salm(args.out, spec)
    except (ShapeError, OSError) as err:
        parser.error(str(err))
    llm = json.loads((out / LLM_BACKBONE_DIR / CONFIG_FILE).read_text())
    mtp = json.loads((out / CONFIG_FILE).read_text()).get("mtp", {}).get("num_nextn_predict_layers", 0)
    kind = (f"Nemotron-H LLM of {len(spec.backbone_pattern)} blocks {spec.backbone_pattern}" if args.backbone == "nemotron_h"
            else f"Qwen3 LLM of {llm['num_hidden_layers']} blocks")
    print(f"wrote {out}: a SpeechLM, {kind}, hidden {llm['hidden_size']}, vocabulary {llm['vocab_size']}, "
          f"MTP heads {mtp}; train against it with model.pretrained_name={out}")
    return 0


def _preset_defaults(spec: TinyMTPSpec) -> dict:
    """The command line's defaults that give ``spec`` (its Nemotron-H and shape options)."""
    s = spec.sizes
    return {
        "backbone_pattern": spec.backbone_pattern, "native_names": spec.native_names,
        "experts": spec.n_routed_experts, "experts_per_token": spec.num_experts_per_tok,
        "mamba_heads": spec.mamba_num_heads, "mamba_head_dim": spec.mamba_head_dim,
        "prompt_format": spec.prompt_format, "encoder_chunk_seconds": spec.encoder_chunk_size_seconds,
        "heads": spec.heads, "hidden_size": s.hidden_size, "attention_heads": s.num_attention_heads,
        "kv_heads": s.num_key_value_heads, "head_dim": s.head_dim, "intermediate_size": s.intermediate_size,
    }


if __name__ == "__main__":
    sys.exit(main())
