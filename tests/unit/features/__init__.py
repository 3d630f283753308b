"""features/: auto_shard, optimizers and clipping, checkpoint jobs."""
