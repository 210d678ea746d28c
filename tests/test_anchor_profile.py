"""Serving's round starts and teacher forcing at every anchor (dflash_train.evaluate.anchors).

The claim the diagnosis rests on: a serving round accepts exactly what teacher forcing gives at
its anchor with the target's greedy reply as context and labels. It is checked on drafts trained
through the real recipe (so they accept some proposals and miss others), request by request.
"""

from __future__ import annotations

import pytest
from test_serving_validation import _recipe

from dflash_train.config.schema import InputConfig
from dflash_train.evaluate.anchors import (
    AFTER_CORRECTION,
    AFTER_FULL,
    FIRST,
    KINDS,
    NOT_A_START,
    AnchorTable,
    anchor_profile,
    round_starts,
)
from dflash_train.evaluate.decoder import StopRule
from dflash_train.evaluate.loading import TargetSource
from dflash_train.evaluate.requests import prompt_embeddings, read_requests
from dflash_train.evaluate.run import TARGET_MTP_HEADS, prepare
from dflash_train.training.recipe import train


def test_round_starts_follow_the_verified_tokens():
    assert round_starts([2, 7, 0, 7, 3], 7) == [(0, FIRST), (3, AFTER_CORRECTION), (11, AFTER_FULL),
                                               (12, AFTER_CORRECTION), (20, AFTER_FULL)]


@pytest.mark.parametrize("variant", ["dflash", "mtp"])
def test_teacher_forcing_at_the_round_starts_reproduces_every_serving_round(variant, tiny_salm_dir, demo_data,
                                                                             tmp_path):
    summary = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "run", f"dflash={variant}",
                            "dflash.serving_val_samples=0"))
    export = str(summary.export_dir)
    target, drafts = ((TargetSource(checkpoint=export), {"d": TARGET_MTP_HEADS}) if variant == "mtp"
                      else (TargetSource(checkpoint=str(tiny_salm_dir)), {"d": export}))
    settings, loaded = prepare(target, drafts, InputConfig(type="lhotse_as_conversation", cuts_path=str(demo_data[1])),
                               max_new_tokens=24, dtype="float32", limit=4)
    context, draft, k = loaded.context, loaded.drafts["d"], settings.num_speculative_tokens
    rule = StopRule(24, frozenset(settings.stop_token_ids))
    profiles = []
    for request in read_requests(settings.data, context.prompt_format, context.estimator, limit=4):
        profile = anchor_profile(context.target, draft, prompt_embeddings(context.target, request.prompt), rule, k)
        assert profile.consistent(), (profile.served, [profile.accepted[j] for j in profile.starts])
        assert profile.kinds[0] == FIRST and len(profile.starts) == len(profile.served)
        profiles.append(profile)
    table = AnchorTable.of(profiles, k)
    assert sum(p.accepted.count(0) for p in profiles) > 0 and sum(sum(p.accepted) for p in profiles) > 0
    starts = table.row([FIRST, AFTER_FULL, AFTER_CORRECTION])
    assert starts[0] == sum(len(p.served) for p in profiles)
    assert starts[1] == pytest.approx(1 + sum(sum(p.served) for p in profiles) / starts[0])  # serving's MAL
    assert table.row(KINDS)[0] == sum(len(p.accepted) for p in profiles) > table.row([NOT_A_START])[0]
