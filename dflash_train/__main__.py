"""``python -m dflash_train`` / ``torchrun -m dflash_train``: same as the ``dflash-train`` script."""

from dflash_train.cli.train import main

if __name__ == "__main__":
    main()
