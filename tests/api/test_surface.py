"""fsdp_compose's public surface equals the installed torch's FSDP2 (``torch.distributed.fsdp.fully_shard``
and friends): every name, every ``FSDPModule`` method with its parameters, every ``fully_shard``
keyword. A torch release that adds or changes one fails here, listing the difference."""

import dataclasses
import inspect
import subprocess
import sys

import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as torch_fsdp2

import fsdp_compose

# Ours only; each has a row in docs/migrating-from-fsdp2.md ("beyond FSDP2").
BEYOND_FSDP2 = {
    "apply_fully_shard", "ShardPlan", "WrapPolicy", "ModuleWrapPolicy", "CustomPolicy", "SizeBasedPolicy",
    "init_sharded_parameters", "sync_module_states", "full_state_dict", "load_full_state_dict",
    "summon_full_params", "clip_grad_norm_", "save_checkpoint", "load_checkpoint", "checkpoint_exists",
    "CheckpointError", "Comm", "AllGather", "ReduceScatter", "explain", "Explanation", "collective_bytes",
    "estimate", "Estimate", "plan", "Plan", "BudgetError", "ExecutionOrderError", "CollectiveError", "quantize_all_gather",
    "load_pretrained", "save_pretrained", "PretrainedCheckpointError", "process_wide_effects",
    "FaultTolerance", "FaultToleranceError",
    # torch's FSDP2 raises a bare AssertionError for these; ours are classes of their own that are one too
    "MeshRoleError", "AlreadyShardedError", "DeepcopyUnsupportedError",
}

# FSDP2 names torch 2.11 (the oldest torch we support) lacks: fsdp_compose offers them on every supported
# torch, so on one without them they are ours alone
NEWER_FSDP2 = {
    "DataParallelMeshDims", "dp_mesh_dims", "reset_iter_state", "set_reduce_scatter_max_input_buffers",
    "set_reduce_scatter_unused_params", "set_separate_reduce_scatter_group", "set_symm_mem_for_comm",
    # torch 2.13 defines it in a private module (_fully_shard/_fsdp_common.py) and exports it from nowhere
    "ShardPlacementResult",
}


def _public_methods(cls) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}


def _shape(fn) -> list[tuple]:
    """Parameter names, kinds and simple defaults: what caller code depends on."""
    shape = []
    for p in inspect.signature(fn).parameters.values():
        default = p.default
        if default is not inspect.Parameter.empty and not isinstance(default, (bool, int, float, str, type(None))):
            default = type(default).__name__  # e.g. MixedPrecisionPolicy(): compare the class name
        shape.append((p.name, p.kind.name, default))
    return shape


def _differences(ours: set[str], theirs: set[str]) -> list[str]:
    return [f"missing in fsdp_compose: {name}" for name in sorted(theirs - ours)]


def test_every_fsdp2_name_is_exported():
    theirs = set(torch_fsdp2.__all__)
    assert theirs <= set(torch_fsdp.__all__)
    ours = set(fsdp_compose.__all__)
    problems = _differences(ours, theirs)
    extra = ours - theirs - BEYOND_FSDP2 - NEWER_FSDP2
    problems += [f"exported but neither FSDP2 nor in BEYOND_FSDP2 (add a docs row): {name}" for name in sorted(extra)]
    problems += [f"BEYOND_FSDP2 lists a name no longer exported: {n}" for n in sorted(BEYOND_FSDP2 - ours)]
    assert not problems, "\n".join(problems)


def test_fsdp_module_methods_match():
    ours, theirs = _public_methods(fsdp_compose.FSDPModule), _public_methods(torch_fsdp.FSDPModule)
    problems = _differences(ours, theirs)
    problems += [f"not in FSDP2's FSDPModule: {n}" for n in sorted(ours - theirs - NEWER_FSDP2)]
    for name in sorted(ours & theirs):
        mine, torchs = _shape(getattr(fsdp_compose.FSDPModule, name)), _shape(getattr(torch_fsdp.FSDPModule, name))
        if mine != torchs:
            problems.append(f"FSDPModule.{name}: ours {mine} vs torch {torchs}")
    assert not problems, "\n".join(problems)


def test_fully_shard_keywords_match():
    mine = {name: shape for name, *shape in _shape(fsdp_compose.fully_shard)}
    torchs = {name: shape for name, *shape in _shape(torch_fsdp.fully_shard)}
    problems = _differences(set(mine), set(torchs))
    problems += [f"fully_shard keyword not in FSDP2: {n}" for n in sorted(set(mine) - set(torchs) - NEWER_FSDP2)]
    for name in sorted(set(mine) & set(torchs)):
        if mine[name] != torchs[name]:
            problems.append(f"fully_shard({name}=...): ours {mine[name]} vs torch {torchs[name]}")
    assert not problems, "\n".join(problems)


def test_policies_and_handles_match():
    problems = []
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"):
        ours = [(f.name, f.default) for f in dataclasses.fields(getattr(fsdp_compose, name))]
        theirs = [(f.name, f.default) for f in dataclasses.fields(getattr(torch_fsdp, name))]
        if ours != theirs:
            problems.append(f"{name} fields: ours {ours} vs torch {theirs}")
    for name in ("UnshardHandle",):
        ours, theirs = _public_methods(getattr(fsdp_compose, name)), _public_methods(getattr(torch_fsdp, name))
        if ours != theirs:
            problems.append(f"{name} methods: ours {sorted(ours)} vs torch {sorted(theirs)}")
    for name in ("register_fsdp_forward_method", "share_comm_ctx"):
        if _shape(getattr(fsdp_compose, name)) != _shape(getattr(torch_fsdp, name)):
            problems.append(f"{name}: ours {_shape(getattr(fsdp_compose, name))} vs torch {_shape(getattr(torch_fsdp, name))}")
    assert not problems, "\n".join(problems)


def test_comm_protocols_match_torchs():
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    for name in ("Comm", "AllGather", "ReduceScatter"):
        ours, theirs = getattr(fsdp_compose, name), getattr(_fsdp_api, name)
        for method in ("allocate", "__call__"):
            if hasattr(theirs, method) and method in vars(theirs):
                assert _shape(getattr(ours, method)) == _shape(getattr(theirs, method)), (name, method)


def test_extras_load_at_first_use():
    """``import fsdp_compose`` loads no extra (the core imports none); their public names resolve when first used."""
    check = (
        "import sys, fsdp_compose\n"
        "assert not [m for m in sys.modules if m.startswith('fsdp_compose.extras')], 'an extra was imported'\n"
        "from fsdp_compose import explain, save_checkpoint\n"
        "assert explain.__module__ == 'fsdp_compose.extras.observe.explain', explain.__module__\n"
        "assert set(fsdp_compose.__all__) <= set(dir(fsdp_compose))\n"
        "assert all(getattr(fsdp_compose, name) is not None for name in fsdp_compose.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True)

