#!/usr/bin/env python
"""The runbook's entry script: ``python scripts/dflash_train.py --config-name=X [overrides]`` and
``torchrun --nproc_per_node=8 scripts/dflash_train.py --config-name=X ...`` run exactly what
``dflash-train`` runs, from any working directory; the shipped recipe (``dflash_train/conf``) is
found by default and ``--config-dir`` adds your own."""

import sys
from pathlib import Path

try:
    from dflash_train.cli.train import main
except ImportError:  # a checkout that is not installed: use the package beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dflash_train.cli.train import main

if __name__ == "__main__":
    main()
