"""``plan``: how to shard a model so one training step fits a per-rank memory budget, chosen on fake
tensors before a launch (``planner.py``), and ``Plan.apply`` to shard it so.
"""
