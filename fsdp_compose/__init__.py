"""fsdp_compose: fully sharded data parallelism by hooks, composable with plain PyTorch.

``fully_shard(module)`` shards a module's parameters on dim 0 across ranks (as DTensors),
all-gathers them just before use and reduce-scatters their gradients. Code written for
``torch.distributed.fsdp.fully_shard`` runs after changing the import.
"""

from .api import fully_shard
from .forward_methods import register_fsdp_forward_method
from .init import init_sharded_parameters, sync_module_states
from .module import FSDPModule, UnshardHandle
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .wrap import CustomPolicy, ModuleWrapPolicy, ShardPlan, SizeBasedPolicy, WrapPolicy, apply_fully_shard

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "init_sharded_parameters",
    "sync_module_states",
    "apply_fully_shard",
    "ShardPlan",
    "WrapPolicy",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "SizeBasedPolicy",
]
