"""Host-device syncs of a training step, counted through the real recipe (docs/training.md, "Host syncs").

On a GPU every sync stalls the Python thread until the device has drained its queue, so the next
step's kernels cannot be queued behind this step's. A training step between log steps may sync at
most three times: the window's all-reduced gradient norm and weight (read once, at the window's end),
nemo_automodel's anchor count, and on padded rows transformers' check for packed position ids. :class:`~dflash_train.testing.host_syncs.HostSyncCounter` sees
them on CPU (scalar reads, data-dependent shapes, ``tolist``); the recipe is the demo's on the tiny
SALM and real speech, DFlash2 (the shipped recipe's variant), two loader workers as users launch it,
padded rows and packed rows.
"""

from __future__ import annotations

import lightning as L
import pytest
from conftest import demo_recipe

from dflash_train.testing.host_syncs import HostSyncCounter
from dflash_train.training import recipe
from dflash_train.training.recipe import train

MAX_SYNCS_PER_STEP = 3
LOG_EVERY = 4
STEPS = 6


class CountSyncs(L.Callback):
    """Host syncs of each training batch, from ``on_train_batch_start`` to ``on_train_batch_end``."""

    def __init__(self):
        self.steps: list[tuple[bool, HostSyncCounter]] = []
        self._counter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        last = trainer.global_step + 1 >= trainer.max_steps  # the run's last step logs its window too
        logs = (trainer.global_step + 1) % trainer.log_every_n_steps == 0 or last  # the step this batch makes
        self._counter = HostSyncCounter().__enter__()
        self.steps.append((logs, self._counter))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._counter.__exit__(None, None, None)


@pytest.fixture(scope="module")
def step_syncs(tiny_salm_dir, demo_data, tmp_path_factory):
    """Per training batch ``(is a log step, counter)``, for padded rows and for packed rows."""
    counted = {}
    for layout, overrides in {
        "padded": [],
        "packed": ["data.train_ds.packing=true", "data.train_ds.batch_tokens=512"],
    }.items():
        callback = CountSyncs()
        original = recipe._callbacks
        recipe._callbacks = lambda *args: original(*args) + [callback]
        try:
            train(demo_recipe(
                tiny_salm_dir, demo_data, tmp_path_factory.mktemp(layout),
                "dflash=dflash2", "dflash.draft_num_hidden_layers=1", "dflash.num_anchors=16",
                f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={LOG_EVERY}", "trainer.val_check_interval=null",
                "trainer.limit_val_batches=0", "data.train_ds.num_workers=2", *overrides,
            ))
        finally:
            recipe._callbacks = original
        counted[layout] = callback.steps
    return counted


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_training_step_syncs_the_host_at_most_three_times_between_log_steps(step_syncs, layout):
    steps = step_syncs[layout]
    assert len(steps) == STEPS
    # the first step also checks the loader's audio frame counts against the perception's, once
    first = steps[0][1]
    assert [site for site in first.sites if "target/audio.py" in site], dict(first.sites)
    between = [counter for logs, counter in steps[1:] if not logs]
    assert len(between) == STEPS - 2 - STEPS // LOG_EVERY
    for counter in between:
        assert counter.total <= MAX_SYNCS_PER_STEP, dict(counter.sites)
    # the count sees real syncs: nemo_automodel's anchor count is one of them on every step
    assert all(any("dflash/core.py" in site for site in counter.sites) for counter in between)


def test_a_log_step_reads_the_window_back_once(step_syncs):
    log_steps = [counter for logs, counter in step_syncs["padded"] if logs]
    assert log_steps
    for counter in log_steps:
        reads = [site for site in counter.sites if "training/module.py" in site and site.startswith("tolist")]
        assert len(reads) == 2, dict(counter.sites)  # the window's norm and weight, and the log window


def test_the_counter_sees_each_kind_of_sync():
    import torch

    values = torch.arange(6.0)
    with HostSyncCounter() as counter:
        values[0].item()
        values.tolist()
        values[values > 2].sum()
        values.nonzero()
        torch.nonzero_static(values, size=6)  # sized on the host: no sync
        values.cumsum(0)
    kinds = sorted(site.split(" at ")[0] for site in counter.sites.elements())
    assert kinds == [
        "data-dependent shape (index.Tensor)",
        "data-dependent shape (nonzero.default)",
        "scalar read",
        "tolist",
    ]
