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
"""

from __future__ import annotations

import json
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
    seed: int = 1234


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
    backbone_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out_dir, spec.tokenizer_vocab, tokenizer_corpus)
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
    torch.manual_seed(spec.seed)
    model = SALM(cfg)
    if spec.lm_head_std is not None:
        with torch.no_grad():
            # HF's 0.02 init gives near-uniform logits (std ~0.16); a trained LM head gives peaked ones.
            model.llm.lm_head.weight.normal_(0.0, spec.lm_head_std)
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
