"""Whole-model operations on a sharded model: state dicts, summon, clipping (checkpoints are an extra).

They act on every group of a model at once, from outside a training step, through the
runtime's state; the runtime never imports them (``fully_shard`` installs the state-dict hooks).
"""
