"""A tiny but real NeMo ``SALM`` target, built offline with random weights.

Tests, the demo and the vLLM smoke test all need a speech LLM that behaves like the
real thing (NeMo's ``SALM`` class, a Qwen3 decoder, a FastConformer perception, an HF
tokenizer with a chat template and the audio tag) but fits in a few MB and needs no
model hub. :func:`build_tiny_salm` writes such a target in the SALM checkpoint layout
that ``SALM.from_pretrained(dir)`` and vLLM's NeMo plugin both read:

    <dir>/config.json            SALM wrapper config (pretrained_weights=False)
    <dir>/model.safetensors      all SALM weights
    <dir>/tokenizer*.json        the LLM tokenizer (root: NeMo redirects tokenizer_path here)
    <dir>/llm_backbone/config.json   the Qwen3 config (NeMo redirects pretrained_llm here)

canary-qwen-2.5b's structure (NeMo's public SALM) at tiny width: ``--tie-word-embeddings``,
``--linear-projection`` (the FastConformer's output goes through one linear layer, NeMo's
``IdentityConnector`` modality adapter, instead of a Conformer adapter) and ``--lora-rank R
--lora-alpha ALPHA`` (LoRA adapters on the LLM, installed by NeMo with PEFT from the config's ``lora``
block and saved under ``llm.base_model.model.*`` with ``lora_A/B.default``; the adapters' B factors are
drawn nonzero, so they change the outputs as trained adapters do).

From the command line, a target of your own shape for a smoke run (every size an option, defaults the
tests' target; ``--help`` lists them):

    python -m dflash_train.testing.tiny_salm --out DIR [--hidden-size H] [--layers L] [--attention-heads A]
        [--kv-heads KV] [--head-dim D] [--intermediate-size I] [--vocab V] [--tokenizer-vocab T] ...

then train against it with ``model.pretrained_name=DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

AUDIO_LOCATOR_TAG = "<|audio|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    AUDIO_LOCATOR_TAG,
    "<think>",
    "</think>",
]

class ShapeError(ValueError):
    """A shape the builders cannot write (one line); their command lines print it as the error."""


MIN_TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS)
"""The smallest byte-level BPE tokenizer: every byte and the special tokens, no merge."""

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a speech model turns sound into words and words into answers",
    "please transcribe the following audio clip",
    "draft models propose tokens and the target verifies them",
    "system user assistant turn prompt answer question",
    "one two three four five six seven eight nine ten",
    "morning evening weather river mountain city station train",
    "she reads a book while he listens to the radio",
    "numbers letters sentences paragraphs and punctuation marks",
    "Hello, world! How are you today? I am fine, thanks.",
]


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen3 block. In a random tiny LLM with tied embeddings the input token's own row,
which is also its LM-head row, dominates the residual stream, so the greedy token tends to repeat the input
and adapters on the attention alone barely move it; adapters on every linear layer (B at std 0.3,
alpha / r = 2) do change the greedy tokens (tests/test_lora_target.py states by how much)."""


TIED_TABLE_STD = 0.1
"""A tied table's scale: the LM head's (``lm_head_std``, 0.5, peaked logits) is also the input embeddings'
then, and at 0.5 every row dominates the block outputs so thoroughly that even adapted models repeat the
prompt's last token; at 0.1 (logits' std about 0.8) the adapted model's greedy tokens vary."""


@dataclass(frozen=True)
class TinySALMSpec:
    """Sizes of the tiny target; defaults keep head_dim >= 32 so vLLM's CPU backend can serve it.

    ``lm_head_std`` scales the random LM head so logits are as peaked as a trained model's
    (with HF's default init every distribution is near uniform and no draft can fit it).
    """

    hidden_size: int = 64
    num_hidden_layers: int = 6
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 128
    tokenizer_vocab: int = 320
    spare_embedding_rows: int = 64
    encoder_d_model: int = 32
    encoder_layers: int = 1
    n_mels: int = 32
    lm_head_std: Optional[float] = 0.5  # None: keep HF's init (a target that will be trained)
    tie_word_embeddings: bool = False  # the LM head shares the embedding table (Qwen3 up to 4B does)
    tied_table_std: float = TIED_TABLE_STD  # ``lm_head_std`` of a tied table
    seed: int = 1234
    linear_projection: bool = False  # NeMo's IdentityConnector adapter: encoder -> one linear layer -> LLM
    lora_rank: int = 0  # 0: no LoRA; else PEFT LoRA of this rank on ``lora_target_modules`` of the LLM
    lora_alpha: float = 8.0  # PEFT scales the adapters' product B @ A by lora_alpha / lora_rank (PEFT's default 8)
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    lora_b_std: float = 0.3  # PEFT starts B at zero (no effect); a trained adapter's B is not (see LORA_TARGET_MODULES)


def lora_config(spec: TinySALMSpec) -> dict:
    """The SALM config's ``lora`` block (PEFT's ``LoraConfig`` keywords, as NeMo passes them) for ``spec``."""
    return {"r": spec.lora_rank, "lora_alpha": spec.lora_alpha, "target_modules": list(spec.lora_target_modules),
            "lora_dropout": 0.0}


def _train_tokenizer(out_dir: Path, vocab_size: int, corpus: Optional[Sequence[str]] = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _CORPUS * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # before anything is written: the config would not have the size asked
        raise ShapeError(
            f"a {vocab_size}-token tokenizer cannot be trained on {'these' if corpus is not None else 'the built-in'} "
            f"texts: they give {tok.get_vocab_size()} (the 256 bytes and {len(SPECIAL_TOKENS)} special tokens, "
            "then one token per merge, as many as the texts hold)"
        )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[AUDIO_LOCATOR_TAG, "<|im_start|>", "<think>", "</think>"],
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _qwen3_config(spec: TinySALMSpec, vocab_size: int, tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def tiny_perception_config(spec: TinySALMSpec, llm_hidden: int) -> dict:
    """FastConformer-style perception (8x dw-striding subsampling, 10 ms hop => 80 ms per frame)."""
    return {
        "target": "nemo.collections.speechlm2.modules.perception.AudioPerceptionModule",
        "output_dim": llm_hidden,
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000,
            "normalize": "per_feature",
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "features": spec.n_mels,
            "n_fft": 512,
            "log": True,
            "frame_splicing": 1,
            "dither": 0.0,
            "pad_to": 0,
            "pad_value": 0.0,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": spec.n_mels,
            "feat_out": -1,
            "n_layers": spec.encoder_layers,
            "d_model": spec.encoder_d_model,
            "subsampling": "dw_striding",
            "subsampling_factor": 8,
            "subsampling_conv_channels": 16,
            "causal_downsampling": False,
            "ff_expansion_factor": 2,
            "self_attention_model": "rel_pos",
            "n_heads": 2,
            "att_context_size": [-1, -1],
            "xscaling": True,
            "untie_biases": True,
            "pos_emb_max_len": 5000,
            "conv_kernel_size": 9,
            "conv_norm_type": "batch_norm",
            "dropout": 0.0,
            "dropout_pre_encoder": 0.0,
            "dropout_emb": 0.0,
            "dropout_att": 0.0,
        },
        "modality_adapter": {
            "_target_": "nemo.collections.speechlm2.modules.perception.IdentityConnector",
            "d_model": spec.encoder_d_model,  # NeMo then projects d_model -> output_dim with one nn.Linear
        } if spec.linear_projection else {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": spec.encoder_d_model,
            "feat_out": -1,
            "n_layers": 1,
            "d_model": spec.encoder_d_model,
            "subsampling_factor": 1,
            "ff_expansion_factor": 2,
            "self_attention_model": "rel_pos",
            "n_heads": 2,
            "att_context_size": [-1, -1],
            "conv_kernel_size": 9,
            "conv_norm_type": "batch_norm",
            "dropout": 0.0,
            "dropout_pre_encoder": 0.0,
            "dropout_emb": 0.0,
            "dropout_att": 0.0,
        },
    }


def build_tiny_salm(
    out_dir: str | Path,
    spec: TinySALMSpec = TinySALMSpec(),
    tokenizer_corpus: Optional[Sequence[str]] = None,
) -> Path:
    """Build a tiny random-weight SALM and save it in the SALM checkpoint layout; returns ``out_dir``.

    ``tokenizer_corpus`` trains the BPE tokenizer on those texts instead of the built-in
    sentences (a target that will be trained on a corpus wants its words as whole tokens).
    Deterministic given ``spec.seed``. Needs no network access.
    """
    import torch
    from nemo.collections.speechlm2.models import SALM

    out_dir = Path(out_dir)
    backbone_dir = out_dir / "llm_backbone"
    tok = _train_tokenizer(out_dir, spec.tokenizer_vocab, tokenizer_corpus)
    backbone_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = len(tok) + spec.spare_embedding_rows
    _qwen3_config(spec, vocab_size, tok).save_pretrained(backbone_dir)

    cfg = {
        "pretrained_llm": str(backbone_dir),
        "tokenizer_path": str(out_dir),
        "pretrained_asr": None,
        "pretrained_weights": False,
        "audio_locator_tag": AUDIO_LOCATOR_TAG,
        "prompt_format": "qwen",
        "freeze_params": [],
        "prevent_freeze_params": [],
        "perception": tiny_perception_config(spec, spec.hidden_size),
    }
    if spec.lora_rank:
        cfg["lora"] = lora_config(spec)
    torch.manual_seed(spec.seed)
    model = SALM(cfg)
    with torch.no_grad():
        if spec.lm_head_std is not None:
            # HF's 0.02 init gives near-uniform logits (std ~0.16); a trained LM head gives peaked ones.
            std = spec.tied_table_std if spec.tie_word_embeddings else spec.lm_head_std
            model.llm.lm_head.weight.normal_(0.0, std)
        for name, param in model.llm.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, spec.lora_b_std)
    model.save_pretrained(out_dir)
    _make_paths_relative(out_dir)
    return out_dir


def _make_paths_relative(out_dir: Path) -> None:
    """Store artifact paths relative to the checkpoint so the directory can be moved.

    NeMo's loader redirects ``tokenizer_path``/``pretrained_llm`` to the root tokenizer
    and ``llm_backbone/`` when it finds them beside ``config.json``.
    """
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pretrained_llm"] = "llm_backbone"
    cfg["tokenizer_path"] = "."
    cfg_path.write_text(json.dumps(cfg, indent=2))


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``<prog>: error: <what>`` (exit status 2), no usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsHelp(argparse.HelpFormatter):
    """``--help`` shows the default of every option that has one (not the absent ``None`` or a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default: %(default)s)"


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def add_shape_arguments(parser: argparse.ArgumentParser, depth_from_pattern: bool = False) -> None:
    """The LLM's and the perception's sizes as options, :class:`TinySALMSpec`'s defaults.

    ``depth_from_pattern``: a builder whose backbone may take its depth from a block pattern; ``--layers``
    then defaults to ``None`` (not given).
    """
    d = TinySALMSpec()
    shape = parser.add_argument_group("shape")

    def size(flag: str, default: int | None, text: str) -> None:
        shape.add_argument(flag, type=positive, metavar="N", default=default, help=text)

    size("--hidden-size", d.hidden_size, "the LLM's hidden size")
    if depth_from_pattern:
        size("--layers", None, f"decoder blocks of a qwen3 backbone ({d.num_hidden_layers} if not given)")
    else:
        size("--layers", d.num_hidden_layers, "decoder blocks")
    size("--attention-heads", d.num_attention_heads, "query heads")
    size("--kv-heads", d.num_key_value_heads, "key-value heads (divide --attention-heads)")
    size("--head-dim", d.head_dim, "width of one attention head (vLLM's CPU backend serves 32 and more)")
    size("--intermediate-size", d.intermediate_size, "the MLPs' width")
    size("--vocab", d.tokenizer_vocab + d.spare_embedding_rows,
         "embedding (and LM head) rows: the tokenizer's tokens, then spare rows (DFlash's mask token is the first)")
    size("--tokenizer-vocab", d.tokenizer_vocab,
         f"BPE tokens trained on the built-in sentences ({MIN_TOKENIZER_VOCAB} and up; they hold about 500)")
    shape.add_argument("--tie-word-embeddings", action="store_true", help="the LM head is the embedding table")
    size("--encoder-layers", d.encoder_layers, "FastConformer layers")
    size("--encoder-d-model", d.encoder_d_model, "FastConformer width (even: 2 attention heads)")
    shape.add_argument("--seed", type=int, metavar="N", default=d.seed, help="seeds every random weight")


def shape_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TinySALMSpec:
    """The :class:`TinySALMSpec` the shape options ask for; a shape no target can have is ``parser.error``."""
    if args.attention_heads % args.kv_heads:
        parser.error(f"--attention-heads {args.attention_heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.vocab < args.tokenizer_vocab:
        parser.error(f"--vocab {args.vocab} has fewer rows than the tokenizer's {args.tokenizer_vocab} tokens "
                     "(--tokenizer-vocab)")
    if args.encoder_d_model % 2:
        parser.error(f"--encoder-d-model {args.encoder_d_model} is odd: the FastConformer's 2 attention heads "
                     "split it in halves")
    return TinySALMSpec(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers or TinySALMSpec.num_hidden_layers,
        num_attention_heads=args.attention_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        tokenizer_vocab=args.tokenizer_vocab,
        spare_embedding_rows=args.vocab - args.tokenizer_vocab,
        encoder_d_model=args.encoder_d_model,
        encoder_layers=args.encoder_layers,
        tie_word_embeddings=args.tie_word_embeddings,
        seed=args.seed,
    )


def add_structure_arguments(parser: argparse.ArgumentParser) -> None:
    """canary-qwen-2.5b's structure beyond the sizes: a linear projection and LoRA adapters on the LLM."""
    d = TinySALMSpec()
    structure = parser.add_argument_group("structure (canary-qwen-2.5b: --tie-word-embeddings --linear-projection "
                                          "--lora-rank R)")
    structure.add_argument("--linear-projection", action="store_true",
                           help="the encoder's output reaches the LLM through one linear layer (NeMo's "
                                "IdentityConnector modality adapter) instead of a 1-layer Conformer adapter")
    structure.add_argument("--lora-rank", type=int, metavar="R", default=d.lora_rank,
                           help="LoRA adapters of rank R on the LLM (PEFT, NeMo's config 'lora' block); 0: none")
    structure.add_argument("--lora-alpha", type=float, metavar="ALPHA", default=d.lora_alpha,
                           help="LoRA scaling numerator: the adapters add (ALPHA / R) * B @ A to each target weight")
    structure.add_argument("--lora-target-modules", metavar="NAMES", default=",".join(d.lora_target_modules),
                           help="comma-separated LLM linear layers that get adapters")


def structure_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, spec: TinySALMSpec
                             ) -> TinySALMSpec:
    """``spec`` with the structure options applied; a rank below 0, no target module or one a Qwen3 block does not
    have is ``parser.error``."""
    from dataclasses import replace

    modules = tuple(name for name in args.lora_target_modules.split(",") if name)
    if args.lora_rank < 0:
        parser.error(f"--lora-rank {args.lora_rank} is negative: give 0 (no LoRA) or a rank >= 1")
    if args.lora_rank and not modules:
        parser.error("--lora-target-modules is empty: name the LLM's linear layers that get adapters, e.g. "
                     "q_proj,v_proj")
    unknown = [name for name in modules if name not in LORA_TARGET_MODULES]
    if args.lora_rank and unknown:
        parser.error(f"--lora-target-modules names {unknown}, not a linear layer of a Qwen3 block; choose from "
                     f"{','.join(LORA_TARGET_MODULES)}")
    return replace(spec, linear_projection=args.linear_projection, lora_rank=args.lora_rank,
                   lora_alpha=args.lora_alpha, lora_target_modules=modules)


def main(argv: list[str] | None = None) -> int:
    """Command line: write one tiny SALM target of the shape asked, print where and how to use it."""
    parser = OneLineErrors(
        prog="python -m dflash_train.testing.tiny_salm",
        description="Write a tiny random-weight NeMo SALM target (Qwen3 LLM, FastConformer perception) in the "
        "SALM.save_pretrained layout, offline.",
        epilog="Train against it with model.pretrained_name=DIR (docs/target.md, \"A target of your own shape for a "
        "smoke run\").",
        formatter_class=DefaultsHelp,
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    add_shape_arguments(parser)
    add_structure_arguments(parser)
    args = parser.parse_args(argv)
    spec = structure_from_arguments(parser, args, shape_from_arguments(parser, args))
    try:
        out = build_tiny_salm(args.out, spec).resolve()
    except (ShapeError, OSError) as err:
        parser.error(str(err))
    llm = json.loads((out / "llm_backbone" / "config.json").read_text())
    print(f"wrote {out}: a SALM target, Qwen3 LLM of {llm['num_hidden_layers']} blocks, hidden {llm['hidden_size']}, "
          f"{llm['num_attention_heads']}/{llm['num_key_value_heads']} attention/key-value heads, vocabulary "
          f"{llm['vocab_size']}{_structure_note(spec)}; train against it with model.pretrained_name={out}")
    return 0



def _structure_note(spec: TinySALMSpec) -> str:
    """What the one line adds for the structure options (empty for the default structure)."""
    notes = ["tied embeddings"] * spec.tie_word_embeddings + ["linear projection"] * spec.linear_projection
    if spec.lora_rank:
        notes.append(f"LoRA rank {spec.lora_rank} alpha {spec.lora_alpha:g} on {','.join(spec.lora_target_modules)}")
    return "".join(f", {note}" for note in notes)


if __name__ == "__main__":
    sys.exit(main())


def without_adapters(lora_dir: Path, out: Path) -> Path:
    """A copy of a LoRA SALM checkpoint without its adapters (the base weights under the plain ``llm.*`` names, no
    ``lora`` block): the adapter-free model the tests compare a LoRA target's outputs against."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(lora_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["lora"]
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(Path(lora_dir) / "model.safetensors"))
    save_file({name.replace("llm.base_model.model.", "llm.").replace(".base_layer.", "."): tensor
               for name, tensor in weights.items() if ".lora_" not in name}, str(out / "model.safetensors"))
    return out
