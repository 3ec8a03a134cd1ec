"""Parameter-server mode: servers that hold the embedding shards, trainers that pull rows
and push row gradients over torch.distributed.rpc (``dist.num_ps``; docs/design.md)."""
