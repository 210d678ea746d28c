"""The Lightning datamodule: configured inputs -> blended, filtered, budgeted ``SpeechBatch`` loaders."""

from __future__ import annotations

import logging
from itertools import chain, islice
from typing import Iterable, Iterator, Optional

import lightning as L
import torch
from lhotse.lazy import LazyIteratorChain, LazyIteratorMultiplexer, LazyRepeater
from torch.utils.data import DataLoader

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.collate import SpeechCollator
from dflash_train.data.conversation import DataError
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.examples import Example, ExampleStream, Filters, Preparer, SkipCounter
from dflash_train.data.inputs import input_name, input_path, open_input
from dflash_train.data.loader import speech_loader
from dflash_train.data.prompt import build_prompt_format
from dflash_train.data.resume import batches_consumed
from dflash_train.data.sampling import build_sampler, token_cap, train_shuffle
from dflash_train.data.validate import check_data_rules

log = logging.getLogger(__name__)

TRAIN_NAME = "train"


def _process_group_topology() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class SpeechDataModule(L.LightningDataModule):
    """Training and named validation loaders of :class:`~dflash_train.data.batch.SpeechBatch`.

    Training: each rank takes its shard of every input (record *i* goes to rank
    ``i % world_size``), repeats it endlessly, blends the inputs by weight, filters, shuffles
    and batches by token budget or batch size; ranks never share a sample and each prepares
    only its own. Validation sets are read once per validation run, in order, by every rank;
    lhotse deals rank *r* every ``world_size``-th batch, so ranks see disjoint samples and the
    same number of batches. Everything is seeded by ``seed``. Samples dropped on the way are
    counted by reason (:meth:`skip_counts`).

    Rank and world size are read when the loaders are built, not at construction: the recipe
    builds this module before ``trainer.fit`` creates the process group. They come from the
    attached trainer (``global_rank`` / ``world_size``), else from an initialised process
    group, else they are 0 of 1; explicit ``rank`` / ``world_size`` arguments override both
    (tests that play one rank in a single process).
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer,
        audio_locator_tag: str,
        estimator: AudioTokenEstimator,
        seed: int,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        super().__init__()
        from nemo.collections.speechlm2.data.utils import get_pad_id  # the pad id SALM itself uses

        check_data_rules(cfg)
        self.cfg = cfg
        self.prompt_format = build_prompt_format(cfg.prompt_format, tokenizer, audio_locator_tag)
        self.estimator = estimator
        self.pad_id = int(get_pad_id(tokenizer))
        self.seed = seed
        self._requested_topology = (rank, world_size)
        self._skips: Optional[SkipCounter] = None
        self._val_sets = self._group_validation_inputs()
        self.val_names: list[str] = list(self._val_sets)
        self._val_streams: dict[str, Iterable[Example]] = {}

    def _topology(self) -> tuple[int, int]:
        if self.trainer is not None:
            found = (self.trainer.global_rank, self.trainer.world_size)
        else:
            found = _process_group_topology()
        rank, world_size = self._requested_topology
        return (found[0] if rank is None else rank, found[1] if world_size is None else world_size)

    @property
    def skips(self) -> SkipCounter:
        """This rank's skip counter, created for the topology in force when first needed (loaders, counts)."""
        if self._skips is None:
            self._skips = SkipCounter(*self._topology())
        return self._skips

    @property
    def rank(self) -> int:
        return self.skips.rank

    @property
    def world_size(self) -> int:
        return self.skips.world_size

    def setup(self, stage: str) -> None:
        """Fix this rank's place in the world now that the trainer (and its process group) exists."""
        if self._skips is not None and (self._skips.rank, self._skips.world_size) != self._topology():
            raise RuntimeError(
                f"SpeechDataModule was used as rank {self._skips.rank} of {self._skips.world_size} before "
                f"the trainer set up rank {self._topology()[0]} of {self._topology()[1]}; build a new data module"
            )
        log.info("data: rank %d of %d", self.rank, self.world_size)

    def _group_validation_inputs(self) -> dict[str, list[InputConfig]]:
        groups: dict[str, list[InputConfig]] = {}
        if self.cfg.validation_ds is not None:
            for inp in self.cfg.validation_ds.input_cfg:
                groups.setdefault(input_name(inp), []).append(inp)
        return groups

    def _streams(self, inputs: list[InputConfig], ds: DatasetConfig, sharded: bool,
                 skips: Optional[SkipCounter] = None) -> list[ExampleStream]:
        prepare = Preparer(
            self.prompt_format, self.estimator, Filters(ds.min_duration, ds.max_duration, token_cap(ds))
        )
        return [
            ExampleStream(
                open_input(inp, self.cfg.system_prompt, self.estimator.sampling_rate, shard_seed=self.seed),
                prepare,
                self.skips if skips is None else skips,
                sharded,
            )
            for inp in inputs
        ]

    def train_examples(self) -> Iterable[Example]:
        """This rank's endless training stream: its shard of every input, repeated, blended by weight."""
        streams = self._streams(self.cfg.train_ds.input_cfg, self.cfg.train_ds, sharded=True)
        repeated = [LazyRepeater(stream, preserve_id=True) for stream in streams]
        if len(repeated) == 1:
            return repeated[0]
        return LazyIteratorMultiplexer(*repeated, weights=[s.source.weight for s in streams], seed=self.train_seed)

    def supervised_sample(self, limit: int) -> Iterator[dict[str, torch.Tensor]]:
        """The training inputs' first ``limit`` usable examples in file order, unsharded (the same on every rank),
        as ``{"input_ids", "loss_mask"}`` rows of one: what counting the data's supervised tokens reads (an
        EAGLE-3 draft vocabulary). Decodes no audio (tarred inputs are read through to those examples); its skips
        are not counted (training counts them)."""
        streams = self._streams(self.cfg.train_ds.input_cfg, self.cfg.train_ds, sharded=False, skips=SkipCounter())
        for example in islice(chain.from_iterable(streams), limit):
            yield {"input_ids": torch.from_numpy(example.input_ids)[None],
                   "loss_mask": torch.from_numpy(example.loss_mask)[None]}

    @property
    def train_seed(self) -> int:
        """Blending and shuffling seed of this rank's training stream: ``seed + rank`` (ranks draw independently)."""
        return self.seed + self.rank

    def validation_examples(self, name: str) -> Iterable[Example]:
        """Validation set ``name``: its inputs once, in order (the same stream object across runs)."""
        if name not in self._val_streams:
            streams = self._streams(self._val_sets[name], self.cfg.validation_ds, sharded=False)
            self._val_streams[name] = streams[0] if len(streams) == 1 else LazyIteratorChain(*streams)
        return self._val_streams[name]

    def _loader(
        self,
        examples: Iterable[Example],
        ds: DatasetConfig,
        shuffle: bool,
        name: str,
        rank: int,
        world_size: int,
        seed: int,
        skip: int = 0,
    ) -> DataLoader:
        sampler = build_sampler(examples, ds, shuffle, seed, rank, world_size)
        collate = SpeechCollator(self.pad_id, self.prompt_format.audio_locator_tag_id, ds.packing, name)
        return speech_loader(sampler, collate, self.skips, ds, skip)

    def train_dataloader(self) -> DataLoader:
        """Endless training batches (``dataset_name='train'``); fails if no input yields a usable sample.

        A resumed run continues the deterministic stream after the batches it already trained on.
        """
        ds = self.cfg.train_ds
        examples = self.train_examples()
        if next(iter(examples), None) is None:
            paths = ", ".join(input_path(inp) for inp in ds.input_cfg)
            raise DataError(
                f"data.train_ds has no usable sample for rank {self.rank} of {self.world_size} in {paths}; "
                f"skipped: {self.skip_counts()}"
            )
        shuffle = train_shuffle(ds)
        skip = batches_consumed(self.trainer)
        if skip:
            log.info("data: resuming the training stream after %d batches", skip)
        # rank 0 of 1: the stream is already this rank's shard
        return self._loader(examples, ds, shuffle, TRAIN_NAME, rank=0, world_size=1, seed=self.train_seed, skip=skip)

    def val_dataloader(self) -> list[DataLoader]:
        """One finite loader per validation set, in :attr:`val_names` order (``dataset_name`` = its name)."""
        ds = self.cfg.validation_ds
        shuffle = False if ds is None or ds.shuffle is None else ds.shuffle
        return [
            self._loader(self.validation_examples(name), ds, shuffle, name, self.rank, self.world_size, self.seed)
            for name in self.val_names
        ]

    def skip_counts(self) -> dict[str, int]:
        """Skipped samples by reason, this rank's share (sum over ranks for the total)."""
        return dict(sorted(self.skips.counts.items()))
