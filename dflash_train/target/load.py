"""From a validated recipe to a frozen target with checked taps and mask token."""

from __future__ import annotations

import logging
from typing import NamedTuple

from dflash_train.config.schema import RunConfig
from dflash_train.config.validate import validate_against_target
from dflash_train.target.salm import SALMTarget, load_salm, read_target_dims
from dflash_train.target.taps import derive_target_layer_ids

log = logging.getLogger(__name__)


class LoadedTarget(NamedTuple):
    """The frozen target plus the tap ids and mask token id the draft will use."""

    target: SALMTarget
    layer_ids: list[int]
    mask_token_id: int


def load_target_for_run(run: RunConfig) -> LoadedTarget:
    """Check taps and mask id against the target's config files, then load and freeze the target."""
    from dflash_train.variants import variant_named

    dims = read_target_dims(run.model)
    d = run.dflash
    if not variant_named(d.variant).uses_taps:
        layer_ids = []  # the draft reads the target's final hidden state, not taps
    elif d.target_layer_ids is None:
        layer_ids = derive_target_layer_ids(dims.num_layers, d.draft_num_hidden_layers)
        log.info("dflash.target_layer_ids derived from target depth %d: %s", dims.num_layers, layer_ids)
    else:
        layer_ids = list(d.target_layer_ids)
    validate_against_target(d, dims, layer_ids)
    target = SALMTarget(load_salm(run.model))
    mask_token_id = d.mask_token_id if d.mask_token_id is not None else target.default_mask_token_id()
    return LoadedTarget(target, layer_ids, mask_token_id)
