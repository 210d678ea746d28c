"""NeMo's sharded formats through NeMo's own readers: lhotse Shar and NeMo tarred audio.

The shards are written here from the demo speech with lhotse's Shar writer and, for NeMo's
tarred layout (``manifest_<k>.json`` + ``audio_<k>.tar``, what NeMo's
``convert_to_tarred_audio_dataset.py`` writes), with ``tarfile``. One audio file inside one
shard is replaced by bytes no decoder reads: it must come back as one counted
``unreadable_audio`` skip, never a crash and never a silent drop. Training from each format
goes through the real recipe and data module, and resumes exactly.
"""

from __future__ import annotations

import http.server
import io
import json
import tarfile
import threading
from functools import partial
from pathlib import Path

import pytest
from conftest import ResumeComparison, demo_recipe
from lhotse import CutSet

from dflash_train.config.schema import InputConfig
from dflash_train.data import inputs
from dflash_train.data.examples import ExampleStream, Filters, Preparer, SkipCounter
from dflash_train.data.inputs import open_input
from dflash_train.data.prompt import build_prompt_format
from dflash_train.data.validate import validate_data_config
from dflash_train.errors import ConfigError
from dflash_train.training.recipe import train

TAG = "<|audio|>"
BAD_INDEX = 3  # the utterance whose audio is replaced by undecodable bytes
GARBAGE = b"this is not audio " * 64


def _replace_member(tar_path: Path, member: str, payload: bytes) -> None:
    """Rewrite ``tar_path`` with ``member``'s bytes replaced by ``payload`` (the rest unchanged)."""
    with tarfile.open(tar_path) as tar:
        members = [(info, tar.extractfile(info).read() if info.isfile() else None) for info in tar.getmembers()]
    assert member in [info.name for info, _ in members], f"{member} is not in {tar_path}"
    with tarfile.open(tar_path, "w") as tar:
        for info, data in members:
            data = payload if info.name == member else data
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def source_cuts(demo_data) -> list:
    return list(CutSet.from_file(demo_data[0]))


@pytest.fixture(scope="module")
def shar_dir(source_cuts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shar")
    CutSet(source_cuts).to_shar(out, fields={"recording": "wav"}, shard_size=8)  # 3 shards: 8 + 8 + 4
    bad = source_cuts[BAD_INDEX]
    _replace_member(out / "recording.000000.tar", f"{bad.id}.wav", GARBAGE)
    return out


@pytest.fixture(scope="module")
def tarred(source_cuts, tmp_path_factory) -> tuple[str, str]:
    """NeMo tarred audio: 2 shards, manifests and tars brace-expanded as NeMo writes them."""
    out = tmp_path_factory.mktemp("tarred")
    shards = [source_cuts[: len(source_cuts) // 2], source_cuts[len(source_cuts) // 2 :]]
    for shard_id, cuts in enumerate(shards):
        with open(out / f"manifest_{shard_id}.json", "w") as manifest, tarfile.open(out / f"audio_{shard_id}.tar",
                                                                                      "w") as tar:
            for cut in cuts:
                name = f"{cut.id}.wav"
                source = Path(cut.recording.sources[0].source)
                data = GARBAGE if cut.id == source_cuts[BAD_INDEX].id else source.read_bytes()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                entry = {"audio_filepath": name, "duration": cut.duration, "text": cut.supervisions[0].text,
                         "shard_id": shard_id, **({"context": cut.custom["context"]} if cut.custom else {})}
                manifest.write(json.dumps(entry) + "\n")
    return str(out / "manifest__OP_0..1_CL_.json"), str(out / "audio_{0..1}.tar")


def _inputs(kind: str, shar_dir: Path, tarred: tuple[str, str]) -> InputConfig:
    if kind == "lhotse_shar":
        return InputConfig(type="lhotse_shar", shar_path=str(shar_dir))
    return InputConfig(type="nemo_tarred", manifest_filepath=tarred[0], tarred_audio_filepaths=tarred[1])


def _stream(inp: InputConfig, tiny_target, audio_estimator, rank: int = 0, world_size: int = 1):
    prompt = build_prompt_format("qwen", tiny_target.tokenizer, TAG)
    counter = SkipCounter(rank, world_size)
    source = open_input(inp, None, audio_estimator.sampling_rate, shard_seed=7)
    return ExampleStream(source, Preparer(prompt, audio_estimator, Filters()), counter, sharded=True), counter


@pytest.mark.parametrize("kind", ["lhotse_shar", "nemo_tarred"])
def test_shards_read_every_utterance_and_count_the_undecodable_one(kind, shar_dir, tarred, source_cuts, tiny_target,
                                                                  audio_estimator):
    inp = _inputs(kind, shar_dir, tarred)
    stream, counter = _stream(inp, tiny_target, audio_estimator)
    examples = list(stream)
    expected = {cut.supervisions[0].text for i, cut in enumerate(source_cuts) if i != BAD_INDEX}
    texts = {tiny_target.tokenizer.tokenizer.decode(ex.input_ids[ex.loss_mask].tolist()).removesuffix("<|im_end|>")
             for ex in examples}
    assert len(examples) == len(source_cuts) - 1 and texts == expected
    assert dict(counter.counts) == {"unreadable_audio": 1}
    # every example's audio is the source utterance's, sample for sample
    by_text = {cut.supervisions[0].text: cut for cut in source_cuts}
    for ex in examples[:3]:
        reply = tiny_target.tokenizer.tokenizer.decode(ex.input_ids[ex.loss_mask].tolist()).removesuffix("<|im_end|>")
        assert ex.audio[0].num_samples == by_text[reply].num_samples
        assert (ex.audio[0].load_audio() == by_text[reply].load_audio()).all()
    # a second pass reads the same order (resume relies on it); skips are not counted twice
    assert [ex.id for ex in stream] == [ex.id for ex in examples] and counter.counts["unreadable_audio"] == 1

    shares = [_stream(inp, tiny_target, audio_estimator, rank, 2) for rank in (0, 1)]
    ids = [[ex.id for ex in stream] for stream, _ in shares]
    assert not set(ids[0]) & set(ids[1]) and sorted(ids[0] + ids[1]) == sorted(ex.id for ex in examples)
    assert sum(counter.counts["unreadable_audio"] for _, counter in shares) == 1


def test_shard_paths_are_checked_locally_and_left_to_lhotse_remotely(shar_dir, tarred, tmp_path):
    from dflash_train.config.schema import DataConfig, DatasetConfig

    def check(inp):
        validate_data_config(DataConfig(train_ds=DatasetConfig(input_cfg=[inp], batch_size=2)))

    check(InputConfig(type="lhotse_shar", shar_path=str(shar_dir)))
    check(InputConfig(type="nemo_tarred", manifest_filepath=tarred[0], tarred_audio_filepaths=tarred[1]))
    for remote in ("s3://bucket/shar", "ais://bucket/shar", "https://example.org/shar"):
        check(InputConfig(type="lhotse_shar", shar_path=remote))
    check(InputConfig(type="nemo_tarred", manifest_filepath="s3://b/manifest_{0..3}.json",
                      tarred_audio_filepaths="pipe:ais get ais://b/audio_{0..3}.tar -"))
    check(InputConfig(type="lhotse_as_conversation", cuts_path="https://example.org/cuts.jsonl.gz"))

    with pytest.raises(ConfigError, match=r"^data.train_ds.input_cfg\[0\].tarred_audio_filepaths='.*audio_\{0..2\}.tar' "
                                          r"\(shard .*audio_2.tar\) does not exist$"):
        check(InputConfig(type="nemo_tarred", manifest_filepath=tarred[0],
                          tarred_audio_filepaths=tarred[1].replace("0..1", "0..2")))
    with pytest.raises(ConfigError, match=r"shar_path='.*' holds no cuts.\* shard; is it a lhotse Shar directory\?$"):
        check(InputConfig(type="lhotse_shar", shar_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"shar_path='.*nowhere' is not a directory"):
        check(InputConfig(type="lhotse_shar", shar_path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"cuts_path='.*gone.jsonl.gz' does not exist$"):
        check(InputConfig(type="lhotse_as_conversation", cuts_path=str(tmp_path / "gone.jsonl.gz")))


def test_a_manifest_served_over_http_is_read_through_lhotse(demo_data, source_cuts, tiny_target, audio_estimator):
    train_cuts = Path(demo_data[0])
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(train_cuts.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{train_cuts.name}"
        inp = InputConfig(type="lhotse_as_conversation", cuts_path=url)
        stream, counter = _stream(inp, tiny_target, audio_estimator)
        assert [ex.id for ex in stream] == [cut.id for cut in source_cuts] and not counter.counts
    finally:
        server.shutdown()
        server.server_close()


def _shard_recipe(kind, tiny_salm_dir, demo_data, shar_dir, tarred, run_dir, steps):
    if kind == "lhotse_shar":
        train_input = f"{{type: lhotse_shar, shar_path: '{shar_dir}'}}"
    else:
        train_input = (f"{{type: nemo_tarred, manifest_filepath: '{tarred[0]}', "
                       f"tarred_audio_filepaths: '{tarred[1]}'}}")
    return demo_recipe(tiny_salm_dir, demo_data, run_dir,
                       f"data.train_ds.input_cfg=[{train_input}]",
                       "data.train_ds.bucket_estimate_samples=16",
                       "data.train_ds.bucket_buffer_size=16",
                       "data.train_ds.shuffle_buffer_size=16",
                       "data.train_ds.batch_tokens=400",
                       f"trainer.max_steps={steps}",
                       "trainer.val_check_interval=2",
                       "trainer.limit_val_batches=1",
                       "+trainer.enable_model_summary=false",
                       "exp_manager.checkpoint_every_n_steps=2",
                       "exp_manager.resume_if_exists=true",
                       "dflash=dflash",
                       "dflash.num_anchors=8",
                       "dflash.serving_val_samples=0")


@pytest.mark.parametrize("kind", ["lhotse_shar", "nemo_tarred"])
def test_training_from_shards_counts_the_bad_file_and_resumes_exactly(kind, tiny_salm_dir, demo_data, shar_dir,
                                                                      tarred, tmp_path):
    def recipe(run_dir, steps):
        return _shard_recipe(kind, tiny_salm_dir, demo_data, shar_dir, tarred, run_dir, steps)

    runs = ResumeComparison(lambda run_dir, steps: train(recipe(run_dir, steps)), tmp_path, 4, 2)
    assert runs.straight.skipped.get("unreadable_audio") == 1, runs.straight.skipped
    worst = runs.worst()
    assert worst <= 1e-6, f"resumed weights differ by {worst}"


@pytest.fixture(scope="module")
def tarred_conversations(source_cuts, tmp_path_factory) -> tuple[str, str, list[str]]:
    """NeMo's tarred conversations, written by NeMo's ``NeMoMultimodalConversationTarWriter`` (3 per shard):
    two spoken questions and two replies each; one audio file in shard 0 is replaced by undecodable bytes."""
    from nemo.collections.common.data.lhotse.text_adapters import (
        AudioTurn,
        NeMoMultimodalConversation,
        NeMoMultimodalConversationTarWriter,
        TextTurn,
    )

    out = tmp_path_factory.mktemp("tarred_conversations")
    ids = []
    with NeMoMultimodalConversationTarWriter(str(out), shard_size=3) as writer:
        for k in range(6):
            first, second = source_cuts[2 * k], source_cuts[2 * k + 1]
            turns = [AudioTurn(first, "user", TAG), TextTurn(first.supervisions[0].text, "assistant"),
                     AudioTurn(second, "user", TAG), TextTurn(second.supervisions[0].text, "assistant")]
            writer.write(NeMoMultimodalConversation(id=f"chat-{k}", turns=turns))
            ids.append(f"chat-{k}")
    with tarfile.open(out / "audio_0.tar") as tar:
        member = next(name for name in tar.getnames() if name.startswith(source_cuts[2].id) and not name.endswith(".json"))
    _replace_member(out / "audio_0.tar", member, GARBAGE)  # the first audio of chat-1
    return str(out / "manifest_{0..1}.jsonl"), str(out / "audio_{0..1}.tar"), ids


def test_tarred_conversations_read_through_nemo_and_count_the_undecodable_one(tarred_conversations, source_cuts,
                                                                             tiny_target, audio_estimator):
    manifests, tars, ids = tarred_conversations
    inp = InputConfig(type="multimodal_conversation", manifest_filepath=manifests, tarred_audio_filepaths=tars)
    validate_data_config_for(inp)
    stream, counter = _stream(inp, tiny_target, audio_estimator)
    examples = list(stream)
    assert [ex.id for ex in examples] == [i for i in ids if i != "chat-1"]
    assert dict(counter.counts) == {"unreadable_audio": 1}
    chat_0 = examples[0]
    assert len(chat_0.audio) == 2 and chat_0.num_supervised > 0
    replies = tiny_target.tokenizer.tokenizer.decode(chat_0.input_ids[chat_0.loss_mask].tolist())
    assert replies == f"{source_cuts[0].supervisions[0].text}<|im_end|>{source_cuts[1].supervisions[0].text}<|im_end|>"
    for audio, cut in zip(chat_0.audio, source_cuts[:2]):
        assert (audio.load_audio() == cut.load_audio()).all()


def validate_data_config_for(inp: InputConfig) -> None:
    from dflash_train.config.schema import DataConfig, DatasetConfig

    validate_data_config(DataConfig(train_ds=DatasetConfig(input_cfg=[inp], batch_size=2)))


def test_an_undecodable_file_in_a_nemo_style_conversation_tar_counts_the_rest_of_its_shard(
        tarred_conversations, tiny_target, audio_estimator, tmp_path):
    """NeMo's own tar layout holds audio only (no lhotse metadata): NeMo's reader decodes each file as it
    reads the tar and cannot go past a broken one, so the rest of that shard is counted, the next shard read."""
    import shutil

    manifests, tars, ids = tarred_conversations
    source = Path(tars).parent
    for shard in (0, 1):
        shutil.copy(source / f"manifest_{shard}.jsonl", tmp_path / f"manifest_{shard}.jsonl")
        with tarfile.open(source / f"audio_{shard}.tar") as src, tarfile.open(tmp_path / f"audio_{shard}.tar", "w") as dst:
            for info in src.getmembers():
                if not info.name.endswith(".json"):
                    dst.addfile(info, src.extractfile(info))
    inp = InputConfig(type="multimodal_conversation", manifest_filepath=str(tmp_path / "manifest_{0..1}.jsonl"),
                      tarred_audio_filepaths=str(tmp_path / "audio_{0..1}.tar"))
    stream, counter = _stream(inp, tiny_target, audio_estimator)
    assert [ex.id for ex in stream] == ["chat-0", "chat-3", "chat-4", "chat-5"]
    assert dict(counter.counts) == {"unreadable_audio": 1, "after_unreadable_audio": 1}


def test_offline_labels_refuse_a_sharded_or_remote_input_before_any_work(shar_dir, tmp_path):
    from dflash_train.evaluate.offline_labels import generate_labels

    for inp in (InputConfig(type="lhotse_shar", shar_path=str(shar_dir)),
                InputConfig(type="lhotse_as_conversation", cuts_path="s3://bucket/cuts.jsonl.gz")):
        with pytest.raises(ConfigError, match=r"^dflash-labels rewrites local cuts, NeMo manifests or conversation "
                                              r"JSONL files; '.*' \(.*\) is sharded or remote"):
            generate_labels(None, None, None, inp, None, tmp_path / "labels.jsonl.gz", {})
    assert not (tmp_path / "labels.jsonl.gz").exists()


@pytest.mark.parametrize("kind,garbage_decodes", [("lhotse_shar", 1), ("nemo_tarred", 0)])
def test_integer_shard_members_are_checked_at_their_header_and_only_the_garbage_one_is_decoded(
        kind, garbage_decodes, shar_dir, tarred, tiny_target, audio_estimator, monkeypatch):
    """16-bit PCM cannot hold NaN: the finite-sample decode is spent only on bytes no header parser reads
    (a Shar's garbage member; NeMo's tarred reader drops its garbage member itself)."""
    decoded = []
    check_finite = inputs._check_finite
    monkeypatch.setattr(inputs, "_check_finite", lambda cut, *args: (decoded.append(cut.id), check_finite(cut, *args)))
    stream, counter = _stream(_inputs(kind, shar_dir, tarred), tiny_target, audio_estimator)
    assert len(list(stream)) > 0 and dict(counter.counts) == {"unreadable_audio": 1} and len(decoded) == garbage_decodes


@pytest.fixture(scope="module")
def odd_shar_dir(source_cuts, tmp_path_factory) -> Path:
    """The demo speech in Shar shards of an odd size (4 shards of 5 records): another shard order moves records from
    one rank's share to the other's (with even shards every record would keep its index's parity)."""
    out = tmp_path_factory.mktemp("odd_shar")
    CutSet(source_cuts).to_shar(out, fields={"recording": "wav"}, shard_size=5)
    return out


def test_the_ranks_of_a_run_deal_a_shar_input_disjointly_and_completely(tiny_salm_dir, tiny_target, demo_data,
                                                                       odd_shar_dir, source_cuts, tmp_path,
                                                                       monkeypatch):
    """Guards the Shar shard order of a multi-rank run: the data module the recipe builds (``build_datamodule``),
    as rank 0 and rank 1 of 2 (told by the process group, as under torchrun before the trainer attaches), must read
    the shards in one order on every rank, so that dealing records by index gives the ranks disjoint shares whose
    union is every record. A shard order seeded per rank (``seed + rank``) makes the ranks deal from different
    orders: shared records and lost ones."""
    import torch.distributed as dist

    from dflash_train.training.recipe import build_datamodule

    run = demo_recipe(tiny_salm_dir, demo_data, tmp_path,
                      f"data.train_ds.input_cfg=[{{type: lhotse_shar, shar_path: '{odd_shar_dir}'}}]",
                      "data.train_ds.use_bucketing=false", "data.train_ds.shuffle=false",
                      "data.train_ds.batch_tokens=400").run
    everything = sorted(cut.id for cut in source_cuts)
    shares = {}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        for rank in (0, 1):
            monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
            module = build_datamodule(run, tiny_target)
            assert (module.rank, module.world_size) == (rank, 2)
            first_pass: list[str] = []  # the ids before the first repeat: unshuffled, the stream's second pass
            for batch in module.train_dataloader():  # endless
                repeats = [i for i in batch.sample_ids if i in first_pass]
                first_pass += batch.sample_ids[:batch.sample_ids.index(repeats[0])] if repeats else batch.sample_ids
                assert len(first_pass) <= len(everything), first_pass
                if repeats:
                    break
            shares[rank] = first_pass
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    shared = set(shares[0]) & set(shares[1])
    lost = set(everything) - set(shares[0]) - set(shares[1])
    assert not shared and not lost, (f"ranks 0 and 1 of 2 share {len(shared)} records and lose {len(lost)} of "
                                     f"{len(everything)}: {sorted(shared)[:4]} / {sorted(lost)[:4]}")
    assert sorted(shares[0] + shares[1]) == everything and abs(len(shares[0]) - len(shares[1])) <= 1
