"""Seeing inside a sharded run: ``explain`` (the plan and its predicted memory and traffic)
and a storage tracker to check the prediction. The profiler labels live in ``runtime/labels.py``:
the runtime emits them and must not depend on this layer.
"""
