"""Train the benchmark's reference target: a tiny NeMo SALM that transcribes synthesized speech.

    .venv/bin/python benchmarks/train_reference_target.py [--steps 1500] [--seed 1234]

One command, deterministic given ``--seed`` (single process, CPU, fixed data order):

1. synthesizes the corpus with espeak-ng (``varied_sentences``: 20 subjects x 20 predicates x
   10 endings, six voices, four speaking rates) into ``benchmarks/.work/corpus`` (git-ignored);
   every ``count // test_count``-th utterance is the held-out test split, never trained on;
2. builds a tiny random-weight SALM whose BPE tokenizer is trained on the corpus sentences;
3. trains all of it for ASR with NeMo's own SALM path (``SALMDataset`` + speechlm2
   ``DataModule`` + ``SALM.training_step`` under Lightning);
4. stores the checkpoint in the SALM layout in ``benchmarks/reference_target/`` and measures
   the target-only greedy WER on the held-out split with the evaluation package's decoder
   (the prompt and decoding ``dflash-eval`` and ``dflash-labels`` use), writing ``card.json``
   and ``README.md`` beside the weights.
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
COUNT = 2600
TEST_COUNT = 100
PROBE_COUNT = 5  # held-out utterances the fast test re-synthesizes and transcribes


def target_spec(seed: int):
    """Sizes of the reference target (head_dim 32 so vLLM's CPU backend can serve it)."""
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


def corpus(count: int = COUNT, test_count: int = TEST_COUNT, jobs: int = 2) -> tuple[Path, Path, list[str]]:
    """The synthesized corpus (built when missing): train cuts, held-out test cuts, all sentences."""
    from dflash_train.data.demo_data import CONTEXTS, varied_sentences, write_demo_data

    sentences = varied_sentences(count)
    train, test = CORPUS / "train_cuts.jsonl.gz", CORPUS / "val_cuts.jsonl.gz"
    if not test.exists():
        write_demo_data(CORPUS, count, test_count, jobs=jobs, sentences=sentences)
    return train, test, sentences + [c for c in CONTEXTS if c]


def held_out_cuts(out: Path, n: int = PROBE_COUNT) -> Path:
    """Re-synthesize the first ``n`` held-out test utterances exactly as the corpus has them (ids, voice, rate,
    context) without building the corpus; returns their cuts file."""
    from dflash_train.data.demo_data import VOICES, _cut_record, _rate, _speak, _write_jsonl_gz, varied_sentences

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


def train_target(steps: int, seed: int, batch_size: int, lr: float) -> dict:
    """Build, train and store the target; returns the training facts for the card."""
    import lightning as L
    import torch
    from nemo.collections.speechlm2.data import DataModule, SALMDataset
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.testing.tiny_salm import build_tiny_salm

    train, test, texts = corpus()
    init_dir = WORK / "target_init"
    if init_dir.exists():
        shutil.rmtree(init_dir)
    build_tiny_salm(init_dir, target_spec(seed), tokenizer_corpus=texts)

    L.seed_everything(seed, workers=True)
    model = SALM.from_pretrained(str(init_dir))
    model.cfg.optimizer = {"_target_": "torch.optim.AdamW", "lr": lr, "betas": [0.9, 0.98], "weight_decay": 0.01}
    model.cfg.lr_scheduler = {
        "_target_": "nemo.core.optim.lr_scheduler.CosineAnnealing",
        "warmup_steps": min(100, steps // 10),
        "max_steps": steps,
        "min_lr": lr / 20,
    }
    datamodule = DataModule(_data_config(train, test, batch_size, seed), tokenizer=model.tokenizer,
                            dataset=SALMDataset(tokenizer=model.tokenizer))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        limit_val_batches=3,
        log_every_n_steps=25,
        gradient_clip_val=1.0,
        logger=L.pytorch.loggers.CSVLogger(str(WORK / "target_logs"), name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        deterministic=True,
        use_distributed_sampler=False,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule)
    wall = time.perf_counter() - started
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}

    if OUT.exists():
        for child in OUT.iterdir():
            if child.name != "README.md":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    OUT.mkdir(parents=True, exist_ok=True)
    for child in init_dir.iterdir():  # tokenizer files and llm_backbone/config.json
        if child.name not in ("model.safetensors", "config.json"):
            shutil.copytree(child, OUT / child.name) if child.is_dir() else shutil.copy(child, OUT / child.name)
    model.cfg.pop("optimizer")
    model.cfg.pop("lr_scheduler")
    model.save_pretrained(str(OUT))
    cfg = json.loads((OUT / "config.json").read_text())
    cfg.update({"pretrained_llm": "llm_backbone", "tokenizer_path": "."})
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    return {
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
    from dflash_train.evaluate.decoder import StopRule, greedy_decode
    from dflash_train.evaluate.loading import TargetSource, default_stop_token_ids, load_target_context
    from dflash_train.evaluate.requests import RequestFailure, prompt_embeddings, read_requests, reply_text
    from dflash_train.evaluate.session import TargetSession
    from dflash_train.evaluate.wer import corpus_wer

    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts))
    ctx = load_target_context(TargetSource(checkpoint=str(target_dir)), inp, "val", None, None, "float32", "cpu")
    rule = StopRule(max_new_tokens, frozenset(default_stop_token_ids(ctx.prompt_format)))
    ids, hyps, refs, truncated = [], [], [], []
    for request in read_requests(inp, ctx.prompt_format, ctx.estimator, ctx.system_prompt, limit=limit):
        if isinstance(request, RequestFailure):
            raise RuntimeError(f"{request.id}: {request.error}")
        decoded = greedy_decode(TargetSession(ctx.target), prompt_embeddings(ctx.target, request.prompt), rule)
        if decoded.finish_reason != "stop":
            truncated.append(request.id)
        ids.append(request.id)
        hyps.append(reply_text(ctx.prompt_format, decoded))
        refs.append(request.reference)
    wer = corpus_wer(ids, hyps, refs)
    return {"wer": wer.to_dict(), "samples": len(ids), "truncated": truncated,
            "examples": [{"id": i, "reference": r, "hypothesis": h} for i, r, h in zip(ids, refs, hyps)]}


def write_card(facts: dict, evaluation: dict) -> None:
    from dflash_train.evaluate.wer import corpus_wer

    wer = evaluation["wer"]
    probe = evaluation["examples"][:PROBE_COUNT]
    probe_wer = corpus_wer([e["id"] for e in probe], [e["hypothesis"] for e in probe], [e["reference"] for e in probe])
    card = {**facts, "test_samples": evaluation["samples"], "test_wer": wer["wer"], "test_wer_detail": wer,
            "test_truncated": evaluation["truncated"], "probe_wer": probe_wer.wer, "probe": probe}
    (OUT / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    size_mb = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file()) / 2**20
    examples = "\n".join(f"| {e['reference']} | {e['hypothesis']} |" for e in evaluation["examples"][:5])
    reading = (
        "The target has learned the sentence grammar (fluent, well-formed replies that stop; high teacher-forced "
        "token accuracy, because most of a phrase follows from its first word) but uses the audio only weakly: "
        "it often picks the wrong subject, predicate or ending. More steps are the obvious lever; this budget "
        "is what fits the CPU time available. For the acceptance benchmark that is still a meaningful target: "
        "its greedy outputs have real language structure, which a draft can learn."
        if wer["wer"] > 0.5 else
        "The target transcribes most words correctly; its errors are mostly confusions between similar phrases."
    )
    (OUT / "README.md").write_text(f"""# Reference target: a tiny NeMo SALM trained for ASR on synthesized speech

The target of the acceptance benchmark (`benchmarks/acceptance.py`, results in
`docs/benchmarks.md`). Real NeMo `SALM` class, SALM checkpoint layout
(`config.json`, `model.safetensors`, tokenizer at the root, `llm_backbone/config.json`),
{facts['parameters'] / 1e6:.2f} M parameters, {size_mb:.1f} MB on disk.

Regenerate (deterministic given the seed; corpus and logs go to `benchmarks/.work/`, git-ignored):

    .venv/bin/python benchmarks/train_reference_target.py --steps {facts['steps']} --seed {facts['seed']}

## Model
- LLM: Qwen3, hidden 128, 6 layers, 4 query heads / 2 KV heads, head_dim 32, MLP 256, random init.
- Tokenizer: byte-level BPE (512 entries + specials, ChatML template, `<|audio|>`) trained on the corpus sentences.
- Perception: FastConformer (64 mel, 8x dw-striding subsampling = 80 ms per frame, 2 layers, d_model 96),
  1-layer Conformer modality adapter, projection to the LLM; all random init, all trained.
- Prompt format `qwen` (ChatML); some utterances carry a user context ("Transcribe the audio." ...).

## Training data
{COUNT} espeak-ng utterances (`dflash_train.data.demo_data.varied_sentences`: 20 subjects x 20
predicates x 10 optional time endings, six voices `en-us`, `en-gb`, `en-gb-scotland`, `en-029`,
`en-us+f3`, `en-gb-x-rp+m3`, speaking rates 135-180 wpm), 16 kHz. Every {COUNT // TEST_COUNT}th
utterance ({TEST_COUNT}) is the held-out test split and is never trained on: its sentences are new
combinations of words and phrases seen in training, spoken by the same voices.

## Training
NeMo's own SALM path: `SALMDataset`, speechlm2 `DataModule` (lhotse, `lhotse_as_conversation`),
`SALM.training_step` (next-token CE on the reply), Lightning on CPU, one process.
{facts['steps']} steps, batch {facts['batch_size']}, AdamW lr {facts['lr']} (cosine, warmup), gradient clip 1.0,
seed {facts['seed']}; wall time {facts['train_wall_s'] / 60:.1f} min on {platform.machine()} with
{facts['torch_threads']} torch threads (2 shared CPU cores). Final train loss {facts['final_train_loss']:.3f},
held-out teacher-forced loss {facts['val_loss']:.3f}, token accuracy {facts['val_token_accuracy']:.3f}.

## Measured quality
Target-only greedy WER on the {evaluation['samples']} held-out utterances (Whisper English normalizer,
jiwer): **{100 * wer['wer']:.1f} %** ({wer['errors']} errors / {wer['reference_words']} words;
{wer['substitutions']} sub, {wer['deletions']} del, {wer['insertions']} ins);
{len(evaluation['truncated'])} replies without a stop token within 48 tokens. On the first {PROBE_COUNT} held-out
utterances (the ones `tests/test_reference_benchmark.py` re-synthesizes) WER is {100 * probe_wer.wer:.1f} %.
`card.json` holds these numbers and those {PROBE_COUNT} transcripts.

{reading}

| reference | target transcript |
|---|---|
{examples}
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-only", action="store_true", help="re-measure the stored target's WER and card")
    args = parser.parse_args(argv)
    if args.eval_only:
        facts = json.loads((OUT / "card.json").read_text())
        facts = {k: facts[k] for k in ("steps", "batch_size", "lr", "seed", "train_wall_s", "parameters",
                                       "final_train_loss", "val_loss", "val_token_accuracy", "torch_threads")}
    else:
        facts = train_target(args.steps, args.seed, args.batch_size, args.lr)
    _, test, _ = corpus()
    evaluation = transcribe(OUT, test)
    write_card(facts, evaluation)
    print(json.dumps({k: v for k, v in facts.items()}, indent=2))
    print(f"held-out WER: {100 * evaluation['wer']['wer']:.1f} % over {evaluation['samples']} utterances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
