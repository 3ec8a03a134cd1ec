"""Checkpoints and recovery: the run's checkpoint directories, the checkpointer of every
stateful component (torch.distributed.checkpoint), the automatic interval, partial recovery
(survivors' snapshots, shard deltas, resident shards), the run lock and failure injection.
Imports nothing else of train/."""
