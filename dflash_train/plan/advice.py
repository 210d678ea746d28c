"""Which knob values make a run that does not fit fit: one knob at a time, each value planned again.

The knobs are the ones that move the per-rank peak without changing what the draft is: anchors per
row, the batch's token budget, the loss chunk, gradient checkpointing, freeing gathered weights after
forward and the expert-parallel size. For each, values are tried from the configured one downwards
(halving) or switched on, and the first that fits is reported with what the plan then needs.
"""

from __future__ import annotations

from typing import Callable, Iterator

from dflash_train.plan.report import GIB, Plan

HALVINGS = 3
"""How many halvings of a numeric knob are planned before giving up on it."""


def _candidates(plan: Plan) -> Iterator[tuple[str, str]]:
    """``(override, what it changes)`` to try, knob by knob (each tried alone against the run as configured)."""
    knobs = plan.knobs
    for key, override_key, floor in (("num_anchors", "dflash.num_anchors", 16),
                                     ("batch_tokens", "data.train_ds.batch_tokens", 256),
                                     ("loss_chunk_size", "dflash.loss_chunk_size", 32)):
        value = knobs.get(key)
        for _ in range(HALVINGS):
            if not value or value // 2 < floor:
                break
            value //= 2
            yield f"{override_key}={value}", key
    if not knobs.get("gradient_checkpointing"):
        yield "dflash.gradient_checkpointing=true", "gradient_checkpointing"
    if knobs.get("strategy") == "fsdp2" and not knobs.get("reshard_after_forward"):
        yield "trainer.strategy.reshard_after_forward=true", "reshard_after_forward"


def fit_advice(plan: Plan, plan_with: Callable[[str], Plan]) -> list[str]:
    """For a plan that does not fit, one line per knob whose value makes it fit (``plan_with(override)``
    plans the run with that one override), the smallest change first; a line saying none did otherwise."""
    if plan.fits:
        return []
    found: dict[str, str] = {}
    for override, knob in _candidates(plan):
        if knob in found:
            continue
        other = plan_with(override)
        if other.fits:
            found[knob] = f"{override} (needs {other.needed_bytes / GIB:.1f} GiB)"
    return list(found.values()) or ["no single knob fits it: combine them, add ranks, or pick a larger GPU"]
