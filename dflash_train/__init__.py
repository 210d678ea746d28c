"""dflash_train."""
