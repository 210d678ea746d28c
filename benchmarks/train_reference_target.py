"""Train a reference target of the benchmark: a tiny NeMo speech LLM that transcribes synthesized speech.

    .venv/bin/python benchmarks/train_reference_target.py [--backbone qwen3|nemotron_h]

(defaults: ``--ctc-steps 300 --steps 200 --seed 1234``; about 2 minutes on 2 quiet CPU cores once the corpus
exists, about 10 when another job shares them). ``--backbone qwen3`` (default) writes NeMo's ``SALM`` with a
Qwen3 LLM to ``benchmarks/reference_target``; ``--backbone nemotron_h`` the runbook's kind of target, a
SpeechLM whose LLM is a Nemotron-H with Mamba-2, attention and MoE blocks (``--pattern``), stored under
``SALMAutomodel``'s native names, to ``benchmarks/reference_target_nemotron_h``.
One command, deterministic given ``--seed`` (single process, CPU, fixed data order):

1. synthesizes the corpus with espeak-ng (``varied_sentences``: 20 subjects x 20 predicates x
   10 endings, six voices, four speaking rates) into ``benchmarks/.work/corpus`` (git-ignored);
   every ``count // test_count``-th utterance is the held-out test split, never trained on;
2. stage 1, encoder pretraining: trains the target's own preprocessor + tiny FastConformer encoder
   (the SALM perception's config) for CTC ASR with NeMo's ASR path (``EncDecCTCModelBPE``, a
   SentencePiece tokenizer trained on the train transcripts, lhotse data, Lightning) and measures
   its greedy CER/WER on the held-out split. A SALM trained from a random encoder ignores the audio
   (its perception collapses to a near-constant output and the LLM guesses from the grammar), so
   like real SALMs this one starts from an ASR encoder (what NeMo's ``pretrained_asr`` does);
3. builds a tiny random-weight SALM whose BPE tokenizer is trained on the train-split sentences and
   copies the stage-1 preprocessor + encoder weights into its perception (the modality adapter,
   projection and LLM stay random);
4. stage 2: trains all of it for ASR with NeMo's own SALM path (``SALMDataset`` + speechlm2
   ``DataModule`` + ``SALM.training_step`` under Lightning; for a Nemotron-H LLM, which NeMo 3.0's
   ``SALM`` cannot build, the same steps run on the Nemotron-H modules, :func:`nemotron_h_speech_asr`);
5. stores the checkpoint in the SALM layout in ``benchmarks/reference_target/`` (``pretrained_asr``
   null, ``pretrained_weights`` false: every weight is in ``model.safetensors``) and measures the
   target-only greedy WER on the held-out split with the evaluation package's decoder (the prompt
   and decoding ``dflash-eval`` and ``dflash-labels`` use), writing ``card.json`` and ``README.md``
   beside the weights. The stage-1 model stays in ``benchmarks/.work/ctc/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / ".work"
CORPUS = WORK / "corpus"
OUT = ROOT / "benchmarks" / "reference_target"
NEMOTRON_H_OUT = ROOT / "benchmarks" / "reference_target_nemotron_h"
NEMOTRON_H_PATTERN = "*ME*ME*"  # attention, Mamba-2 and MoE blocks interleaved as Nemotron-H's hybrid MoE models do
COUNT = 2600
TEST_COUNT = 100
PROBE_COUNT = 5  # held-out utterances the fast test re-synthesizes and transcribes


def target_spec(seed: int):
    """Sizes of the reference targets (head_dim 32 so vLLM's CPU backend can serve it)."""
    from dflash_train.testing.tiny_salm import TinySALMSpec

    return TinySALMSpec(
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        tokenizer_vocab=512,
        spare_embedding_rows=16,
        encoder_d_model=96,
        encoder_layers=2,
        n_mels=64,
        lm_head_std=None,
        seed=seed,
    )


def corpus(count: int = COUNT, test_count: int = TEST_COUNT, jobs: int = 2) -> tuple[Path, Path]:
    """The synthesized corpus (built when missing): train cuts and held-out test cuts."""
    from dflash_train.testing.demo_data import varied_sentences, write_demo_data

    train, test = CORPUS / "train_cuts.jsonl.gz", CORPUS / "val_cuts.jsonl.gz"
    if not test.exists():
        write_demo_data(CORPUS, count, test_count, jobs=jobs, sentences=varied_sentences(count))
    return train, test


def held_out_cuts(out: Path, n: int = PROBE_COUNT) -> Path:
    """Re-synthesize the first ``n`` held-out test utterances exactly as the corpus has them (ids, voice, rate,
    context) without building the corpus; returns their cuts file."""
    from dflash_train.testing.demo_data import VOICES, _cut_record, _rate, _speak, _write_jsonl_gz, varied_sentences

    sentences = varied_sentences(COUNT)
    stride = COUNT // TEST_COUNT
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(0, stride * n, stride):
        wav = out / "wavs" / f"demo-{i:04d}.wav"
        _speak((sentences[i], str(wav), VOICES[i % len(VOICES)], _rate(i)))
        records.append(_cut_record(i, sentences[i], wav))
    path = out / "held_out_cuts.jsonl.gz"
    _write_jsonl_gz(path, records)
    return path


def _data_config(train: Path, test: Path, batch_size: int, seed: int):
    from omegaconf import OmegaConf

    from dflash_train.testing.tiny_salm import AUDIO_LOCATOR_TAG

    common = {
        "prompt_format": "qwen",
        "token_equivalent_duration": 0.08,
        "num_workers": 0,
        "batch_size": batch_size,
        "seed": seed,
        "shard_seed": seed,
        "sample_rate": 16000,
    }
    source = {"type": "lhotse_as_conversation", "audio_locator_tag": AUDIO_LOCATOR_TAG}
    return OmegaConf.create(
        {
            "train_ds": {**common, "input_cfg": [{**source, "cuts_path": str(train)}], "shuffle": True},
            "validation_ds": {
                **common,
                "datasets": {"test": {"input_cfg": [{**source, "cuts_path": str(test)}]}},
                "shuffle": False,
            },
        }
    )


def _cut_texts(cuts: Path) -> tuple[list[str], list[str], list[str]]:
    """Ids, audio paths and transcripts of a cuts file."""
    from lhotse import CutSet

    cut_list = list(CutSet.from_file(cuts))
    return ([c.id for c in cut_list], [c.recording.sources[0].source for c in cut_list],
            [c.supervisions[0].text for c in cut_list])


def _cpu_trainer(steps: int, log_dir: Path):
    """The Lightning trainer of both stages: one CPU process, deterministic, one validation at the end."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        limit_val_batches=3,
        log_every_n_steps=25,
        gradient_clip_val=1.0,
        logger=L.pytorch.loggers.CSVLogger(str(log_dir), name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        deterministic=True,
        use_distributed_sampler=False,
    )


def _ctc_tokenizer(train: Path, out: Path, vocab_size: int) -> Path:
    """A SentencePiece unigram tokenizer trained on the train-split transcripts, laid out as NeMo's ASR models
    read it (``tokenizer.model``, ``tokenizer.vocab``, ``vocab.txt``); returns its directory."""
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    _, _, texts = _cut_texts(train)
    (out / "text.txt").write_text("\n".join(texts) + "\n")
    spm.SentencePieceTrainer.train(input=str(out / "text.txt"), model_prefix=str(out / "tokenizer"),
                                   vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
                                   num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    (out / "vocab.txt").write_text("".join(sp.id_to_piece(i) + "\n" for i in range(sp.get_piece_size())))
    return out


def pretrain_encoder(steps: int, seed: int, batch_size: int, lr: float, vocab_size: int) -> tuple[dict, dict]:
    """Stage 1: CTC pretraining of the target's own preprocessor + FastConformer encoder with NeMo's ASR path
    (``EncDecCTCModelBPE`` under Lightning) on the train split; returns the ``preprocessor.*``/``encoder.*``
    weights for the SALM perception and the facts for the card (with the held-out greedy CTC CER/WER)."""
    import jiwer
    import lightning as L
    import torch
    from nemo.collections.asr.models import EncDecCTCModelBPE
    from omegaconf import OmegaConf

    from dflash_train.evaluate.wer import corpus_wer, normalize
    from dflash_train.testing.tiny_salm import tiny_perception_config

    train, test = corpus()
    work = WORK / "ctc"
    if work.exists():
        shutil.rmtree(work)
    tokenizer_dir = _ctc_tokenizer(train, work / "tokenizer", vocab_size)
    spec = target_spec(seed)
    perception = tiny_perception_config(spec, spec.hidden_size)  # the SALM's own preprocessor/encoder config
    common = {"use_lhotse": True, "num_workers": 0, "batch_size": batch_size, "seed": seed, "shard_seed": seed,
              "sample_rate": 16000}
    cfg = OmegaConf.create({
        "sample_rate": 16000,
        "preprocessor": perception["preprocessor"],
        "encoder": perception["encoder"],
        "decoder": {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": spec.encoder_d_model,
                    "num_classes": -1, "vocabulary": []},
        "tokenizer": {"dir": str(tokenizer_dir), "type": "bpe"},
        "optim": {"name": "adamw", "lr": lr, "betas": [0.9, 0.98], "weight_decay": 0.01,
                  "sched": {"name": "CosineAnnealing", "warmup_steps": min(100, steps // 10), "max_steps": steps,
                            "min_lr": lr / 20}},
        "train_ds": {**common, "cuts_path": str(train), "shuffle": True},
        "validation_ds": {**common, "cuts_path": str(test), "shuffle": False},
    })
    L.seed_everything(seed, workers=True)
    trainer = _cpu_trainer(steps, work / "logs")
    model = EncDecCTCModelBPE(cfg, trainer=trainer)
    started = time.perf_counter()
    trainer.fit(model)
    wall = time.perf_counter() - started
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    model.save_to(str(work / "encoder_ctc.nemo"))  # for inspection; the SALM gets the weights below

    model.eval()
    ids, audio, refs = _cut_texts(test)
    with torch.no_grad():
        hyps = model.transcribe(audio, batch_size=batch_size, verbose=False)
    hyps = [getattr(h, "text", h) for h in hyps]
    wer = corpus_wer(ids, hyps, refs)
    cer = jiwer.cer([normalize(r) for r in refs], [normalize(h) for h in hyps])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if k.startswith(("preprocessor.", "encoder."))}
    facts = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "tokenizer_vocab": vocab_size,
        "train_wall_s": round(wall, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": metrics.get("train_loss"),
        "test_wer": wer.wer,
        "test_cer": cer,
        "test_samples": len(ids),
        "examples": [{"id": i, "reference": r, "hypothesis": h} for i, r, h in list(zip(ids, refs, hyps))[:3]],
    }
    return state, facts


def output_dir(backbone: str) -> Path:
    """Where the reference target with this LLM backbone is stored."""
    return NEMOTRON_H_OUT if backbone == "nemotron_h" else OUT


def nemotron_h_spec(seed: int, pattern: str):
    """The Nemotron-H reference target: the Qwen3 target's sizes and perception, Nemotron-H blocks ``pattern``,
    HF's initialisation, stored under ``SALMAutomodel``'s native names, no MTP heads."""
    from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec

    return TinyMTPSpec(backbone="nemotron_h", backbone_pattern=pattern, native_names=True, heads=0, weight_std=None,
                       sizes=target_spec(seed))


def nemotron_h_speech_asr(checkpoint: Path):
    """NeMo's own SALM training and validation steps on the modules of a Nemotron-H SpeechLM checkpoint.

    NeMo 3.0's ``SALM`` cannot build a Nemotron-H LLM (its constructor moves ``llm.model.embed_tokens`` out of
    the LLM; Nemotron-H calls the table ``embeddings``), so this subclass takes the place of that constructor
    only: the checkpoint is loaded by the project's target loader, the embedding table moved out as SALM moves
    its own, and SALM's ``prepare_inputs`` (audio encoding, placeholder replacement, targets),
    ``training_step``, ``validation_step`` and ``configure_optimizers`` run unchanged."""
    from lightning import LightningModule
    from nemo.collections.speechlm2.models import SALM
    from omegaconf import DictConfig

    from dflash_train.target.nemotron_h import NemotronHSpeechLMTarget, native_llm_state

    class NemotronHSpeechASR(SALM):
        def __init__(self, target: NemotronHSpeechLMTarget):
            LightningModule.__init__(self)
            self.cfg = DictConfig(target.salm_config)
            self.audio_locator_tag = target.audio_locator_tag
            self.tokenizer = target.tokenizer
            self.llm = target.causal_lm
            self.embed_tokens = self.llm.model.embeddings
            del self.llm.model.embeddings
            self.perception = target.perception
            self._use_fsdp = self._use_tp = False

        def speechlm_weights(self) -> dict:
            """The trained weights under the checkpoint's names (``perception.*``; ``llm.*`` native)."""
            llm = {**self.llm.state_dict(), "model.embeddings.weight": self.embed_tokens.weight}
            perception = {f"perception.{k}": v for k, v in self.perception.state_dict().items()}
            return {k: v.detach().contiguous() for k, v in {**perception, **native_llm_state(llm)}.items()}

    module = NemotronHSpeechASR(NemotronHSpeechLMTarget.from_checkpoint(checkpoint))
    module.requires_grad_(True)  # the target loader freezes what it loads (and sets eval mode)
    module.train()
    return module


def train_target(steps: int, seed: int, batch_size: int, lr: float, encoder_state: dict | None = None,
                 backbone: str = "qwen3", pattern: str = NEMOTRON_H_PATTERN) -> dict:
    """Build, train and store the target (its perception initialized from ``encoder_state``, the CTC-pretrained
    preprocessor + encoder, when given); returns the training facts for the card."""
    import lightning as L
    import torch
    from nemo.collections.speechlm2.data import DataModule, SALMDataset
    from nemo.collections.speechlm2.models import SALM
    from safetensors.torch import load_file, save_file

    from dflash_train.testing.demo_data import CONTEXTS
    from dflash_train.testing.tiny_mtp_salm import build_tiny_mtp_salm
    from dflash_train.testing.tiny_salm import build_tiny_salm

    train, test = corpus()
    out = output_dir(backbone)
    init_dir = WORK / f"target_init_{backbone}"
    if init_dir.exists():
        shutil.rmtree(init_dir)
    # The tokenizer learns from the train split only: no held-out sentence shapes its vocabulary.
    texts = _cut_texts(train)[2] + [c for c in CONTEXTS if c]
    if backbone == "nemotron_h":
        build_tiny_mtp_salm(init_dir, nemotron_h_spec(seed, pattern), tokenizer_corpus=texts)
    else:
        build_tiny_salm(init_dir, target_spec(seed), tokenizer_corpus=texts)

    L.seed_everything(seed, workers=True)
    model = nemotron_h_speech_asr(init_dir) if backbone == "nemotron_h" else SALM.from_pretrained(str(init_dir))
    if encoder_state is not None:
        # What NeMo's ``pretrained_asr`` does (copy an ASR model's preprocessor + encoder weights into the
        # perception), from the in-memory stage-1 model; the stored config keeps pretrained_asr null.
        loaded = model.perception.load_state_dict(encoder_state, strict=False)
        own = {k for k in model.perception.state_dict() if k.startswith(("preprocessor.", "encoder."))}
        if loaded.unexpected_keys or own - set(encoder_state):
            raise RuntimeError(f"CTC encoder does not match the perception: unexpected {loaded.unexpected_keys}, "
                               f"not loaded {sorted(own - set(encoder_state))}")
    model.cfg.optimizer = {"_target_": "torch.optim.AdamW", "lr": lr, "betas": [0.9, 0.98], "weight_decay": 0.01}
    model.cfg.lr_scheduler = {
        "_target_": "nemo.core.optim.lr_scheduler.CosineAnnealing",
        "warmup_steps": min(100, steps // 10),
        "max_steps": steps,
        "min_lr": lr / 20,
    }
    datamodule = DataModule(_data_config(train, test, batch_size, seed), tokenizer=model.tokenizer,
                            dataset=SALMDataset(tokenizer=model.tokenizer))
    trainer = _cpu_trainer(steps, WORK / f"target_logs_{backbone}")
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    wall = time.perf_counter() - started
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}

    if out.exists():
        for child in out.iterdir():
            if child.name != "README.md":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for child in init_dir.iterdir():  # tokenizer files and llm_backbone/config.json
        if child.name not in ("model.safetensors", "config.json"):
            shutil.copytree(child, out / child.name) if child.is_dir() else shutil.copy(child, out / child.name)
    model.cfg.pop("optimizer")
    model.cfg.pop("lr_scheduler")
    if backbone == "nemotron_h":  # the builder's layout and names, every tensor trained
        weights = model.speechlm_weights()
        stored = set(load_file(str(init_dir / "model.safetensors")))
        if set(weights) != stored:
            raise RuntimeError(f"trained weights do not match the built checkpoint's names: "
                               f"{sorted(set(weights) ^ stored)[:5]}")
        save_file(weights, str(out / "model.safetensors"))
        cfg = json.loads((init_dir / "config.json").read_text())
    else:
        model.save_pretrained(str(out))
        cfg = json.loads((out / "config.json").read_text())
    cfg.update({"pretrained_llm": "llm_backbone", "tokenizer_path": "."})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "backbone": backbone,
        **({"pattern": pattern} if backbone == "nemotron_h" else {}),
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_wall_s": round(wall, 1),
        "parameters": n_params,
        "final_train_loss": metrics.get("loss"),
        "val_loss": metrics.get("val_loss"),
        "val_token_accuracy": metrics.get("val_acc"),
        "torch_threads": torch.get_num_threads(),
    }


def transcribe(target_dir: Path, cuts: Path, limit: int | None = None, max_new_tokens: int = 48) -> dict:
    """Target-only greedy transcripts of ``cuts`` (the evaluation package's prompt and decoder) and their WER."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.decoder import StopRule
    from dflash_train.evaluate.loading import TargetSource, default_stop_token_ids, load_target_context
    from dflash_train.evaluate.requests import RequestFailure, greedy_reply, prompt_embeddings, read_requests
    from dflash_train.evaluate.wer import corpus_wer

    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts))
    ctx = load_target_context(TargetSource(checkpoint=str(target_dir)), inp, "val", None, None, "float32", "cpu")
    rule = StopRule(max_new_tokens, frozenset(default_stop_token_ids(ctx.prompt_format)))
    ids, hyps, refs, truncated = [], [], [], []
    for request in read_requests(inp, ctx.prompt_format, ctx.estimator, ctx.system_prompt, limit=limit):
        if isinstance(request, RequestFailure):
            raise RuntimeError(f"{request.id}: {request.error}")
        decoded, text = greedy_reply(ctx.target, ctx.prompt_format, prompt_embeddings(ctx.target, request.prompt), rule)
        if decoded.finish_reason != "stop":
            truncated.append(request.id)
        ids.append(request.id)
        hyps.append(text)
        refs.append(request.reference)
    wer = corpus_wer(ids, hyps, refs)
    return {"wer": wer.to_dict(), "samples": len(ids), "truncated": truncated,
            "examples": [{"id": i, "reference": r, "hypothesis": h} for i, r, h in zip(ids, refs, hyps)]}


def _model_description(facts: dict) -> tuple[str, str, str, str]:
    """The card's title, class and layout line, LLM line and stage-2 line for the target's backbone."""
    if facts.get("backbone") == "nemotron_h":
        pattern = facts["pattern"]
        kinds = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
        blocks = ", ".join(f"{pattern.count(k)} {name}" for k, name in kinds.items() if k in pattern)
        return (
            "a tiny Nemotron-H SpeechLM trained for ASR on synthesized speech",
            "NeMo's SpeechLM checkpoint layout with a Nemotron-H LLM, the LLM under `SALMAutomodel`'s native names\n"
            "(`mixer._fp32_params.*`, packed `gate_and_up_projs` / `down_projs` experts), the runbook's kind of target",
            f"- LLM: Nemotron-H, hidden 128, blocks `{pattern}` ({blocks}; 4 query heads / 2 KV heads, head_dim 32;\n"
            "  Mamba-2 4 heads x 16, state 16; MoE 4 routed experts, top-2, and a shared expert), HF's init.",
            "Stage 2: NeMo's own SALM steps (`SALMDataset`, speechlm2 `DataModule`, `SALM.prepare_inputs` and\n"
            "`SALM.training_step`: next-token CE on the reply) on the Nemotron-H modules (NeMo 3.0's `SALM` cannot\n"
            "build a Nemotron-H LLM; `nemotron_h_speech_asr` in the script), Lightning on CPU, one process.",
        )
    return (
        "a tiny NeMo SALM trained for ASR on synthesized speech",
        "Real NeMo `SALM` class, SALM checkpoint layout",
        "- LLM: Qwen3, hidden 128, 6 layers, 4 query heads / 2 KV heads, head_dim 32, MLP 256, random init.",
        "Stage 2: NeMo's own SALM path: `SALMDataset`, speechlm2 `DataModule` (lhotse, `lhotse_as_conversation`),\n"
        "`SALM.training_step` (next-token CE on the reply), Lightning on CPU, one process.",
    )


def write_card(facts: dict, evaluation: dict, out: Path = OUT) -> None:
    from dflash_train.evaluate.wer import corpus_wer

    wer = evaluation["wer"]
    probe = evaluation["examples"][:PROBE_COUNT]
    probe_wer = corpus_wer([e["id"] for e in probe], [e["hypothesis"] for e in probe], [e["reference"] for e in probe])
    card = {**facts, "test_samples": evaluation["samples"], "test_wer": wer["wer"], "test_wer_detail": wer,
            "test_truncated": evaluation["truncated"], "probe_wer": probe_wer.wer, "probe": probe}
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    title, layout, llm_line, stage_two = _model_description(facts)
    backbone_flag = f" --backbone {facts['backbone']}" if facts.get("backbone") == "nemotron_h" else ""
    examples = "\n".join(f"| {e['reference']} | {e['hypothesis']} |" for e in evaluation["examples"][:5])
    ctc = facts["encoder_pretraining"]
    if wer["wer"] > 0.5:
        reading = (
            "The target has learned the sentence grammar but uses the audio only weakly: it often picks the "
            "wrong subject, predicate or ending."
        )
    elif wer["wer"] > 0.1:
        reading = (
            "The target transcribes most words correctly; its errors are mostly confusions between similar "
            "phrases (a wrong subject, predicate or ending)."
        )
    else:
        reading = (
            "The target transcribes the held-out speech almost perfectly: the sentences are new combinations "
            "of a small closed vocabulary, spoken by voices seen in training, so this is an easy task once the "
            "perception carries the audio. Its replies are exact transcripts, not free language; for the "
            "acceptance benchmark that means the draft predicts a real ASR model's outputs."
        )
    (out / "README.md").write_text(f"""# Reference target: {title}

A target of the acceptance benchmark (`benchmarks/acceptance.py`, results in
`docs/benchmarks.md`). {layout}
(`config.json`, `model.safetensors`, tokenizer at the root, `llm_backbone/config.json`),
{facts['parameters'] / 1e6:.2f} M parameters, {size_mb:.1f} MB on disk.

Regenerate (deterministic given the seed; corpus and logs go to `benchmarks/.work/`, git-ignored):

    .venv/bin/python benchmarks/train_reference_target.py{backbone_flag} \\
        --ctc-steps {ctc['steps']} --steps {facts['steps']} --seed {facts['seed']}

## Model
{llm_line}
- Tokenizer: byte-level BPE (512 entries + specials, ChatML template, `<|audio|>`) trained on the train-split sentences and prompt contexts.
- Perception: FastConformer (64 mel, 8x dw-striding subsampling = 80 ms per frame, 2 layers, d_model 96)
  initialized from the stage-1 CTC model below; 1-layer Conformer modality adapter and projection to the
  LLM, random init. All of it trained in stage 2.
- Prompt format `qwen` (ChatML); some utterances carry a user context ("Transcribe the audio." ...).
- `config.json` keeps `pretrained_weights: false`: every weight, the perception's too, is in `model.safetensors`.

## Training data
{COUNT} espeak-ng utterances (`dflash_train.testing.demo_data.varied_sentences`: 20 subjects x 20
predicates x 10 optional time endings, six voices `en-us`, `en-gb`, `en-gb-scotland`, `en-029`,
`en-us+f3`, `en-gb-x-rp+m3`, speaking rates 135-180 wpm), 16 kHz. Every {COUNT // TEST_COUNT}th
utterance ({TEST_COUNT}) is the held-out test split and is never trained on (by either stage): its
sentences are new combinations of words and phrases seen in training, spoken by the same voices.

## Training
Stage 1, encoder pretraining (an earlier target trained the same way from a random encoder ignored the
audio: its perception output collapsed to nearly a constant, the LLM guessed from the grammar, 78.5 % WER).
NeMo's ASR path: `EncDecCTCModelBPE` with the perception's own preprocessor and encoder config, a
`ConvASRDecoder` head and a SentencePiece unigram tokenizer ({ctc['tokenizer_vocab']} pieces) trained on the
train transcripts, lhotse data, Lightning on CPU. {ctc['steps']} steps, batch {ctc['batch_size']}, AdamW lr
{ctc['lr']} (cosine, warmup), gradient clip 1.0; {ctc['parameters'] / 1e6:.2f} M parameters; wall time
{ctc['train_wall_s'] / 60:.1f} min. Held-out greedy CTC transcripts (the {ctc['test_samples']} test utterances,
Whisper normalizer): **CER {100 * ctc['test_cer']:.1f} %, WER {100 * ctc['test_wer']:.1f} %**. Its preprocessor +
encoder weights initialize the SALM perception (the CTC head is dropped).

{stage_two}
{facts['steps']} steps, batch {facts['batch_size']}, AdamW lr {facts['lr']} (cosine, warmup), gradient clip 1.0,
seed {facts['seed']}; wall time {facts['train_wall_s'] / 60:.1f} min on {platform.machine()} with
{facts['torch_threads']} torch threads (2 shared CPU cores). Final train loss {facts['final_train_loss']:.3f},
held-out teacher-forced loss {facts['val_loss']:.3f}, token accuracy {facts['val_token_accuracy']:.3f}.

The whole command (both stages, storing, the held-out evaluation; the corpus already synthesized) took
{facts['command_wall_s'] / 60:.1f} min.

## Measured quality
Target-only greedy WER on the {evaluation['samples']} held-out utterances (float32 LLM, perception in
bfloat16 as vLLM serves it; Whisper English normalizer, jiwer): **{100 * wer['wer']:.1f} %**
({wer['errors']} errors / {wer['reference_words']} words;
{wer['substitutions']} sub, {wer['deletions']} del, {wer['insertions']} ins);
{len(evaluation['truncated'])} replies without a stop token within 48 tokens. On the first {PROBE_COUNT} held-out
utterances (the ones `tests/test_reference_benchmark.py` re-synthesizes) WER is {100 * probe_wer.wer:.1f} %.
`card.json` holds these numbers and those {PROBE_COUNT} transcripts; the test also checks that silence of the
same length gives other transcripts (the target listens to the audio, not just its length).

{reading}

| reference | target transcript |
|---|---|
{examples}
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="SALM training steps (stage 2)")
    parser.add_argument("--seed", type=int, default=1234, help="seeds both stages (weights, data order)")
    parser.add_argument("--batch-size", type=int, default=16, help="both stages")
    parser.add_argument("--lr", type=float, default=3e-3, help="SALM peak learning rate")
    parser.add_argument("--ctc-steps", type=int, default=300, help="CTC encoder pretraining steps (stage 1)")
    parser.add_argument("--ctc-lr", type=float, default=3e-3, help="CTC peak learning rate")
    parser.add_argument("--ctc-vocab", type=int, default=128, help="CTC SentencePiece vocabulary size")
    parser.add_argument("--eval-only", action="store_true", help="re-measure the stored target's WER and card")
    parser.add_argument("--backbone", choices=["qwen3", "nemotron_h"], default="qwen3",
                        help="the LLM: Qwen3 in NeMo's SALM, or Nemotron-H (Mamba-2 / attention / MoE blocks)")
    parser.add_argument("--pattern", default=NEMOTRON_H_PATTERN,
                        help="with --backbone nemotron_h: its blocks, M (Mamba-2), * (attention), - (MLP), E (MoE)")
    args = parser.parse_args(argv)
    out = output_dir(args.backbone)
    started = time.perf_counter()
    if args.eval_only:
        facts = json.loads((out / "card.json").read_text())
        facts = {k: facts[k] for k in ("backbone", "pattern", "steps", "batch_size", "lr", "seed", "train_wall_s",
                                       "parameters", "final_train_loss", "val_loss", "val_token_accuracy",
                                       "torch_threads", "encoder_pretraining", "command_wall_s") if k in facts}
    else:
        encoder_state, ctc_facts = pretrain_encoder(args.ctc_steps, args.seed, args.batch_size, args.ctc_lr,
                                                    args.ctc_vocab)
        print(json.dumps(ctc_facts, indent=2))
        facts = train_target(args.steps, args.seed, args.batch_size, args.lr, encoder_state, args.backbone,
                             args.pattern)
        facts["encoder_pretraining"] = ctc_facts
    _, test = corpus()
    evaluation = transcribe(out, test)
    if not args.eval_only:  # corpus synthesis (when missing), both stages, storing and the held-out evaluation
        facts["command_wall_s"] = round(time.perf_counter() - started, 1)
    write_card(facts, evaluation, out)
    print(json.dumps({k: v for k, v in facts.items()}, indent=2))
    print(f"held-out WER: {100 * evaluation['wer']['wer']:.1f} % over {evaluation['samples']} utterances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
