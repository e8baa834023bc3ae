"""Seeing inside a sharded run: ``explain`` (the plan and its predicted memory and traffic),
profiler labels for every collective, and a storage tracker to check the prediction.

Kept import-free so ``runtime/`` can import ``observe.labels`` without a cycle.
"""
