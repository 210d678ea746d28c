"""Synthesize the demo speech dataset: short English sentences spoken by espeak-ng, as lhotse cuts.

    python -m dflash_train.testing.demo_data --out demo_assets/data [--count 352] [--val-count 32]

Writes ``<out>/wavs/*.wav`` (16 kHz mono), ``<out>/train_cuts.jsonl.gz`` and
``<out>/val_cuts.jsonl.gz``. The sentences are :func:`varied_sentences`, generated here from
fixed word lists (the distribution the stored reference target, ``benchmarks/reference_target``,
was trained to transcribe); voice, speaking rate and prompt vary per utterance. The output is
byte-for-byte deterministic for a given ``--out``, ``--count`` and ``--val-count``.

The default split (every 11th of 352 utterances to validation) holds out sentences whose subject
and predicate training has in other combinations. A stride sharing a factor with the 20
predicates of :func:`demo_sentences` (e.g. every 10th of 320) would hold out only a few
predicates, none of them ever trained on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path

SUBJECTS = [
    "the old sailor", "my little sister", "a quiet student", "the baker next door", "our new teacher",
    "the tired driver", "a curious child", "the village doctor", "my best friend", "the young pilot",
    "a patient farmer", "the night guard", "her older brother", "the busy waiter", "a careful painter",
    "the museum guide", "his grandmother", "the train conductor", "a friendly neighbor", "the team captain",
]
PREDICATES = [
    "opened the window before breakfast", "walked home along the river", "found a coin under the bench",
    "wrote a letter to an old friend", "planted tomatoes in the garden", "missed the last bus again",
    "fixed the broken chair in an hour", "sang quietly while cooking dinner", "counted the boats in the harbor",
    "forgot the umbrella at the station", "painted the fence bright green", "read the map by candle light",
    "carried two heavy boxes upstairs", "waited for the rain to stop", "baked fresh bread on sunday",
    "listened to the radio all evening", "cleaned the kitchen after the party", "fed the ducks at the pond",
    "climbed the hill to watch the sunset", "lost the keys in the snow",
]
# Optional endings that multiply the sentence space for larger corpora (see varied_sentences).
TIMES = [
    None, "this morning", "last night", "on monday", "after work", "before lunch",
    "in the spring", "every weekend", "two days ago", "during the storm",
]
CONTEXTS = [None, "Transcribe the audio.", "Write down what you hear.", "Repeat what the speaker says."]
VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-029", "en-us+f3", "en-gb-x-rp+m3"]
WORDS_PER_MINUTE = [135, 150, 165, 180]
DEMO_COUNT, DEMO_VAL_COUNT = 352, 32  # `make demo`'s speech set: 320 train / 32 validation utterances


def demo_sentences(count: int) -> list[str]:
    """``count`` distinct sentences (at most 400), spread over every subject and predicate."""
    combos = list(product(range(len(SUBJECTS)), range(len(PREDICATES))))
    if count > len(combos):
        raise ValueError(f"at most {len(combos)} distinct demo sentences; asked for {count}")
    # A fixed stride coprime with 400 walks all combinations in a mixed-up but reproducible order.
    order = [combos[(i * 137) % len(combos)] for i in range(count)]
    return [f"{SUBJECTS[s].capitalize()} {PREDICATES[p]}." for s, p in order]


def varied_sentences(count: int) -> list[str]:
    """``count`` distinct sentences (at most 4000): every demo sentence with an optional time ending.

    The first ``len(SUBJECTS) * len(PREDICATES)`` combinations of subject and predicate are
    walked as in :func:`demo_sentences`; the ending changes with a stride of its own, so
    subjects, predicates and endings all vary along the list.
    """
    n_pairs = len(SUBJECTS) * len(PREDICATES)
    total = n_pairs * len(TIMES)
    if count > total:
        raise ValueError(f"at most {total} distinct varied sentences; asked for {count}")
    pairs = list(product(range(len(SUBJECTS)), range(len(PREDICATES))))
    out = []
    for i in range(count):
        k = (i * 1571) % total  # 1571 is coprime with 4000: a mixed-up walk over every combination
        s, p = pairs[(k % n_pairs * 137) % n_pairs]
        time = TIMES[k // n_pairs]
        tail = f" {time}" if time else ""
        out.append(f"{SUBJECTS[s].capitalize()} {PREDICATES[p]}{tail}.")
    return out


def _rate(index: int) -> int:
    """Speaking rate of utterance ``index``: changes every two utterances, so it varies against the voice."""
    return WORDS_PER_MINUTE[(index // 2) % len(WORDS_PER_MINUTE)]


def _speak(job: tuple[str, str, str, int]) -> str:
    from dflash_train.testing.speech import synthesize

    text, path, voice, wpm = job
    synthesize(text, path, voice=voice, words_per_minute=wpm)
    return path


def _cut_record(index: int, text: str, wav: Path) -> dict:
    from lhotse import Recording, SupervisionSegment

    cut_id = f"demo-{index:04d}"
    recording = Recording.from_file(str(wav), recording_id=cut_id)
    cut = recording.to_cut()
    cut.supervisions = [
        SupervisionSegment(cut_id, cut_id, start=0.0, duration=recording.duration, text=text, language="en")
    ]
    context = CONTEXTS[index % len(CONTEXTS)]
    if context is not None:
        cut.custom = {"context": context}
    return cut.to_dict()


def _write_jsonl_gz(path: Path, records: list[dict]) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
        for record in records:
            handle.write((json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))


def write_demo_data(
    out: str | Path,
    count: int = 352,
    val_count: int = 32,
    jobs: int = 2,
    sentences: list[str] | None = None,
) -> tuple[Path, Path]:
    """Synthesize ``count`` utterances into ``out``; every ``count // val_count``-th one goes to validation.

    ``sentences`` (``count`` of them) replaces the demo sentences, e.g. :func:`varied_sentences`
    for a corpus larger than 400 utterances. Returns the train and validation cut manifests.
    """
    if not 0 < val_count < count:
        raise ValueError(f"val_count={val_count} must be between 1 and count-1={count - 1}")
    out = Path(out).resolve()
    wav_dir = out / "wavs"
    wav_dir.mkdir(parents=True, exist_ok=True)
    if sentences is None:
        sentences = demo_sentences(count)
    elif len(sentences) != count:
        raise ValueError(f"{len(sentences)} sentences given for count={count}")
    jobs_list = [
        (text, str(wav_dir / f"demo-{i:04d}.wav"), VOICES[i % len(VOICES)], _rate(i))
        for i, text in enumerate(sentences)
    ]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            wavs = list(pool.map(_speak, jobs_list, chunksize=8))
    else:
        wavs = [_speak(job) for job in jobs_list]
    records = [_cut_record(i, text, Path(wav)) for i, (text, wav) in enumerate(zip(sentences, wavs))]
    stride = count // val_count
    val_index = set(range(0, stride * val_count, stride))
    train_path, val_path = out / "train_cuts.jsonl.gz", out / "val_cuts.jsonl.gz"
    _write_jsonl_gz(train_path, [r for i, r in enumerate(records) if i not in val_index])
    _write_jsonl_gz(val_path, [r for i, r in enumerate(records) if i in val_index])
    return train_path, val_path


def write_demo_set(out: str | Path, jobs: int = 2) -> tuple[Path, Path]:
    """``make demo``'s speech set (what ``python -m dflash_train.testing.demo_data --out OUT`` writes)."""
    return write_demo_data(out, DEMO_COUNT, DEMO_VAL_COUNT, jobs, varied_sentences(DEMO_COUNT))


def is_demo_set(out: str | Path) -> bool:
    """Whether ``out`` holds :func:`write_demo_set`'s validation sentences; ``False`` for a set written by an
    earlier demo with other sentences or split, or none."""
    path = Path(out) / "val_cuts.jsonl.gz"
    if not path.is_file():
        return False
    with gzip.open(path, "rt") as handle:
        texts = [json.loads(line)["supervisions"][0]["text"] for line in handle if line.strip()]
    sentences, stride = varied_sentences(DEMO_COUNT), DEMO_COUNT // DEMO_VAL_COUNT
    return texts == [sentences[i] for i in range(0, stride * DEMO_VAL_COUNT, stride)]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: parse arguments, synthesize, print where the manifests are."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--count", type=int, default=DEMO_COUNT, help="utterances in total (at most 4000)")
    parser.add_argument("--val-count", type=int, default=DEMO_VAL_COUNT, help="utterances held out for validation")
    parser.add_argument("--jobs", type=int, default=2, help="parallel espeak-ng processes")
    args = parser.parse_args(argv)
    train, val = write_demo_data(args.out, args.count, args.val_count, args.jobs, varied_sentences(args.count))
    print(f"demo data: {args.count - args.val_count} training cuts in {train}, {args.val_count} in {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
