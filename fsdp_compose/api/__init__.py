"""The public API: fully_shard, FSDPModule and its settings, policies, placement and meshes."""
