"""Seeing inside a sharded run: ``explain`` (the plan and its predicted memory and traffic),
``estimate`` (one fake training step at any world size: will it fit?)
and a storage tracker to check the prediction. The profiler labels live in ``_runtime/collectives.py``:
the runtime emits them and must not depend on this layer.
"""
