"""``dflash-smoke``: the runbook's smoke run (docs/training.md, step 4) automated on the user's own recipe.

The recipe's own :func:`~dflash_train.training.recipe.train` runs three times into a fresh directory
(uninterrupted to N steps; stopped at N/2; resumed to N), with :class:`~dflash_train.smoke.meter.SmokeMeter`
measuring each fit; :mod:`dflash_train.smoke.checklist` turns what the runs left into one table of
pass / fail items with their evidence, and the figures (step time by phase, tokens/s, MFU, memory,
host syncs, recompiles).
"""
