"""fsdp_compose: fully sharded data parallelism by hooks, composable with plain PyTorch.

``fully_shard(module)`` shards a module's parameters on dim 0 across ranks (as DTensors),
all-gathers them just before use and reduce-scatters their gradients. Code written for
torch's FSDP2 ``fully_shard`` runs after changing the import.

Beyond FSDP2: ``explain(model)`` prints the sharding plan with its traffic and predicted memory;
``estimate(build, world_size=N)`` answers "will it fit?" before a launch, running one training
step of ``build``'s model as one of ``N`` ranks on fake tensors in a subprocess and reporting the
per-rank peak memory by category (activations included) and the collectives per step.
"""

from .api import fully_shard
from .comm import AllGather, Comm, ReduceScatter
from .forward_methods import register_fsdp_forward_method
from .init import init_sharded_parameters, sync_module_states
from .module import FSDPModule, UnshardHandle
from .module_settings import share_comm_ctx
from .observe.estimate import Estimate, estimate
from .observe.explain import Explanation, collective_bytes, explain
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .quantize import quantize_all_gather
from .runtime.c10d_direct import CollectiveError
from .runtime.handshake import ExecutionOrderError
from .runtime.placement import ShardPlacementResult
from .spmd_mesh import DataParallelMeshDims
from .whole_model.checkpoint import exists as checkpoint_exists
from .whole_model.checkpoint import load_checkpoint, save_checkpoint
from .whole_model.checkpoint_check import CheckpointError
from .whole_model.clip import clip_grad_norm_
from .whole_model.state_dict import full_state_dict, load_full_state_dict
from .whole_model.summon import summon_full_params
from .wrap import CustomPolicy, ModuleWrapPolicy, ShardPlan, SizeBasedPolicy, WrapPolicy, apply_fully_shard

__all__ = [
    "fully_shard",
    "FSDPModule",
    "DataParallelMeshDims",
    "ShardPlacementResult",
    "UnshardHandle",
    "share_comm_ctx",
    "Comm",
    "AllGather",
    "ReduceScatter",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "quantize_all_gather",
    "init_sharded_parameters",
    "sync_module_states",
    "apply_fully_shard",
    "ShardPlan",
    "WrapPolicy",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "SizeBasedPolicy",
    "full_state_dict",
    "load_full_state_dict",
    "summon_full_params",
    "clip_grad_norm_",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_exists",
    "CheckpointError",
    "explain",
    "estimate",
    "Estimate",
    "Explanation",
    "collective_bytes",
    "ExecutionOrderError",
    "CollectiveError",
]
