"""features/: checkpoints and file IO, auto_shard, optimizers."""
