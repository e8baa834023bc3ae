"""fsdp_compose: fully sharded data parallelism by hooks, composable with plain PyTorch.

``fully_shard(module)`` shards a module's parameters on dim 0 across ranks (as DTensors),
all-gathers them just before use and reduce-scatters their gradients. Code written for
torch's FSDP2 ``fully_shard`` runs after changing the import.

Beyond FSDP2: ``explain(model)`` prints the sharding plan with its traffic and predicted memory;
``estimate(build, world_size=N)`` answers "will it fit?" before a launch, running one training
step of ``build``'s model as one of ``N`` ranks on fake tensors in a subprocess and reporting the
per-rank peak memory by category (activations included) and the collectives per step;
``plan(build, world_size=N, budget="60GiB")`` chooses how to shard it to fit (groups, activation
checkpointing, ``reshard_after_forward``, CPU offload) and ``Plan.apply(model)`` shards it so.
``load_pretrained`` / ``save_pretrained`` read and write Hugging Face safetensors checkpoints straight
into and out of the shards (each rank only its rows).
``process_wide_effects()`` lists what ``fully_shard`` installed for the whole process (an optimizer hook, an
import hook, an exit handler), each with why and its opt-out.
Those, checkpoints, the quantized all-gather, auto-wrap and deferred init live in ``extras/``;
this module names them in ``_EXTRAS`` and imports one only when it is first used (PEP 562), so
the core imports no extra.
"""

import importlib
import logging

from .api.fully_shard import MeshRoleError, fully_shard
from .api.comm import AllGather, Comm, ReduceScatter
from .api.forward_methods import register_fsdp_forward_method
from .api.module import AlreadyShardedError, DeepcopyUnsupportedError, FSDPModule, UnshardHandle
from .api.module_settings import share_comm_ctx
from .api.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._runtime.collectives import CollectiveError
from ._runtime.process_wide import process_wide_effects
from ._checks.order import ExecutionOrderError
from .api.placement import ShardPlacementResult
from .api.spmd_mesh import DataParallelMeshDims
from .whole_model.clip import clip_grad_norm_
from .whole_model.state_dict import full_state_dict, load_full_state_dict
from .whole_model.summon import summon_full_params

# The one source of the version: pyproject.toml reads it from here ([tool.setuptools.dynamic]), so a checkout on
# PYTHONPATH reports its own, not that of another one installed in the environment.
__version__ = "0.1.1"  # 0.1.1: checkpoints store extra as plain data, not a pickle

# What the library reports as information (timings, what it installed) goes to this logger and its children
# (fsdp_compose.<module>); it shows nothing until the program configures logging (docs/observability.md).
# Mistakes in the user's program stay warnings.warn.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# public name -> (module of the extras, its name there)
_EXTRAS = {
    "explain": ("fsdp_compose.extras.observe.explain", "explain"),
    "Explanation": ("fsdp_compose.extras.observe.explain", "Explanation"),
    "collective_bytes": ("fsdp_compose.extras.observe.explain", "collective_bytes"),
    "estimate": ("fsdp_compose.extras.observe.estimate", "estimate"),
    "Estimate": ("fsdp_compose.extras.observe.estimate", "Estimate"),
    "plan": ("fsdp_compose.extras.plan.planner", "plan"),
    "Plan": ("fsdp_compose.extras.plan.planner", "Plan"),
    "BudgetError": ("fsdp_compose.extras.plan.planner", "BudgetError"),
    "save_checkpoint": ("fsdp_compose.extras.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("fsdp_compose.extras.checkpoint", "load_checkpoint"),
    "checkpoint_exists": ("fsdp_compose.extras.checkpoint", "exists"),
    "CheckpointError": ("fsdp_compose.extras.checkpoint", "CheckpointError"),
    "quantize_all_gather": ("fsdp_compose.extras.quantize", "quantize_all_gather"),
    "init_sharded_parameters": ("fsdp_compose.extras.deferred_init", "init_sharded_parameters"),
    "sync_module_states": ("fsdp_compose.extras.deferred_init", "sync_module_states"),
    "apply_fully_shard": ("fsdp_compose.extras.wrap", "apply_fully_shard"),
    "ShardPlan": ("fsdp_compose.extras.wrap", "ShardPlan"),
    "WrapPolicy": ("fsdp_compose.extras.wrap", "WrapPolicy"),
    "ModuleWrapPolicy": ("fsdp_compose.extras.wrap", "ModuleWrapPolicy"),
    "CustomPolicy": ("fsdp_compose.extras.wrap", "CustomPolicy"),
    "SizeBasedPolicy": ("fsdp_compose.extras.wrap", "SizeBasedPolicy"),
    "load_pretrained": ("fsdp_compose.extras.pretrained", "load_pretrained"),
    "save_pretrained": ("fsdp_compose.extras.pretrained", "save_pretrained"),
    "PretrainedCheckpointError": ("fsdp_compose.extras.pretrained", "PretrainedCheckpointError"),
    "FaultTolerance": ("fsdp_compose.extras.fault_tolerance", "FaultTolerance"),
    "FaultToleranceError": ("fsdp_compose.extras.fault_tolerance", "FaultToleranceError"),
}


def __getattr__(name: str) -> object:
    """An extra's public name, imported at its first use and kept."""
    if name not in _EXTRAS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXTRAS[name]
    value = globals()[name] = getattr(importlib.import_module(module), attribute)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXTRAS})


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
    "load_pretrained",
    "save_pretrained",
    "PretrainedCheckpointError",
    "FaultTolerance",
    "FaultToleranceError",
    "explain",
    "estimate",
    "Estimate",
    "plan",
    "Plan",
    "BudgetError",
    "Explanation",
    "collective_bytes",
    "ExecutionOrderError",
    "CollectiveError",
    "process_wide_effects",
    "MeshRoleError",
    "AlreadyShardedError",
    "DeepcopyUnsupportedError",
]
