"""Optimizers that update whole matrices of sharded parameters (opt-in; ``fully_shard`` never imports this)."""

from .exchange import assign_owners
from .matrix import OwnerComputedMuon, UpdateFn
from .muon import newton_schulz, newton_schulz_work

__all__ = ["OwnerComputedMuon", "UpdateFn", "assign_owners", "newton_schulz", "newton_schulz_work"]
