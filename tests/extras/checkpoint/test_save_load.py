"""save_checkpoint / load_checkpoint: exact resume in new processes, resharding, atomicity, clear refusals."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compose import CheckpointError, load_checkpoint, save_checkpoint
from tests.harness import RankFailure, pool, run_on_ranks
from tests.models import (
    TinyLM,
    global_batch,
    lm_loss,
    local_slice,
    max_abs_diff,
    mean_across_ranks,
    shard_blocks_then_root,
)


def _setup(seed: int = 0, n_blocks: int = 3):
    torch.manual_seed(seed)
    model = TinyLM(n_blocks)
    shard_blocks_then_root(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        loss = lm_loss(model, local_slice(global_batch(step, world), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_across_ranks(loss))
    return losses


def _full_params(model: nn.Module) -> dict:
    return {n: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in model.named_parameters()}


def _diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(max_abs_diff(a[k], b[k]) for k in a)


# ----- resume -------------------------------------------------------------------------------
def _train_six_and_save_after_three(path: str) -> dict:
    model, opt = _setup()
    straight = _train(model, opt, range(6))
    model, opt = _setup()
    _train(model, opt, range(3))
    save_checkpoint(path, model, opt, step=3, extra={"data_position": 3})
    return {"straight": straight, "params_at_3": _full_params(model)}


def _resume(path: str) -> dict:
    model, opt = _setup(seed=1)  # other initial values: everything must come from the checkpoint
    step, extra = load_checkpoint(path, model, opt)
    loaded = _full_params(model)
    return {"step": step, "extra": extra, "loaded": loaded, "losses": _train(model, opt, range(step, 6))}


@pytest.mark.slow  # fresh processes
def test_resume_in_new_processes_matches_uninterrupted(tmp_path):
    path = str(tmp_path / "ckpt")
    first = run_on_ranks(2, _train_six_and_save_after_three, path)[0]
    pool(2).kill()  # resume in new processes
    for r in run_on_ranks(2, _resume, path):
        assert (r["step"], r["extra"]) == (3, {"data_position": 3})
        assert _diff(r["loaded"], first["params_at_3"]) == 0.0
        for ours, straight in zip(r["losses"], first["straight"][3:]):
            assert abs(ours - straight) <= 1e-6, (r["losses"], first["straight"])


def test_checkpoint_reshards_from_4_to_2_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(4, _train_six_and_save_after_three, path)[0]
    for r in run_on_ranks(2, _resume, path):
        assert r["step"] == 3 and _diff(r["loaded"], saved["params_at_3"]) == 0.0


# ----- atomicity: a rank dying mid-save leaves the previous checkpoint ------------------------
def _save_once(path: str) -> dict:
    model, opt = _setup()
    _train(model, opt, range(1))
    save_checkpoint(path, model, opt, step=1)
    save_checkpoint(path, model, opt, step=1)  # overwriting a complete checkpoint works too
    return _full_params(model)


def _die_while_saving(path: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = _setup()
    _train(model, opt, range(2))
    if dist.get_rank() == 1:

        def write_then_die(self, plan, planner):
            Path(self.path, "__1_0.distcp").write_bytes(b"half a shard")
            os._exit(1)

        FileSystemWriter.write_data = write_then_die
    save_checkpoint(path, model, opt, step=2)


def _load_after_crash(path: str) -> dict:
    model, opt = _setup(seed=3)
    step, _ = load_checkpoint(path, model, opt)
    out = {"step": step, "params": _full_params(model)}
    if dist.get_rank() == 0:  # a save that died between its two renames: the previous one is used
        previous = Path(path).with_name(f".{Path(path).name}.previous")
        shutil.rmtree(previous)
        Path(path).rename(previous)
    dist.barrier()
    out["fallback_step"] = load_checkpoint(path, model, opt)[0]
    save_checkpoint(path, model, opt, step=4)  # and the next save cleans up
    out["after"] = sorted(p.name for p in Path(path).parent.iterdir())
    return out


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, _save_once, path)[0]
    with pytest.raises(RankFailure):
        run_on_ranks(2, _die_while_saving, path)  # the harness kills the pool
    assert (tmp_path / ".ckpt.partial").exists()
    for r in run_on_ranks(2, _load_after_crash, path):
        assert r["step"] == 1 and r["fallback_step"] == 1
        assert _diff(r["params"], saved) == 0.0
        assert r["after"] == [".ckpt.previous", "ckpt"], r["after"]


# ----- refusals: wrong model, missing keys, shapes, corruption --------------------------------
class _WideHead(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(self.head.in_features, 41)


def _expect_refusal(path: str, model, opt, pattern: str) -> None:
    before = _full_params(model)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path, model, opt)
    assert _diff(_full_params(model), before) == 0.0, "a refused load changed the model"


def _refusals(root: str) -> bool:
    path = os.path.join(root, "ckpt")
    model, opt = _setup()
    _train(model, opt, range(1))
    save_checkpoint(path, model, opt, step=1)
    save_checkpoint(os.path.join(root, "model_only"), model, step=1)

    bigger, bigger_opt = _setup(n_blocks=4)
    _expect_refusal(path, bigger, bigger_opt, r"missing key 'model\.blocks\.3\.fc1\.weight'")
    smaller, smaller_opt = _setup(n_blocks=2)
    _expect_refusal(path, smaller, smaller_opt, r"unexpected key 'model\.blocks\.2\.")
    torch.manual_seed(0)
    wide = _WideHead()
    shard_blocks_then_root(wide)
    wide_opt = torch.optim.AdamW(wide.parameters())
    _expect_refusal(path, wide, wide_opt, r"key 'model\.head\.weight': shape \(37, 13\) in the checkpoint, \(41, 13\)")
    fresh, fresh_opt = _setup(seed=2)
    _expect_refusal(os.path.join(root, "model_only"), fresh, fresh_opt, r"missing key 'optim\.state\.")
    _expect_refusal(os.path.join(root, "nowhere"), fresh, fresh_opt, r"no checkpoint at")

    # corruption: a truncated shard file fails the read, and nothing is loaded
    dist.barrier()
    if dist.get_rank() == 0:
        shard = Path(path, "__1_0.distcp")
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    _expect_refusal(path, fresh, fresh_opt, r"file '.*__1_0\.distcp': 100 bytes, \d+ recorded")
    dist.barrier()
    if dist.get_rank() == 0:
        Path(path, ".metadata").write_bytes(b"garbage")
    dist.barrier()
    _expect_refusal(path, fresh, fresh_opt, r"file '.*\.metadata': \d+ bytes")
    fresh_model_only, _ = _setup(seed=2)
    load_checkpoint(os.path.join(root, "model_only"), fresh_model_only)  # model alone is fine
    return _diff(_full_params(fresh_model_only), _full_params(model)) == 0.0


def test_mismatched_or_corrupt_checkpoint_is_refused_by_key(tmp_path):
    assert all(run_on_ranks(2, _refusals, str(tmp_path)))


def _rank0_file_failure(blocker: str) -> str:
    """The checkpoint's parent is a file, so rank 0 cannot create the temporary directory."""
    model, opt = _setup()
    try:
        save_checkpoint(os.path.join(blocker, "ckpt"), model, opt, step=1)
    except CheckpointError as error:
        return str(error).split(":")[0]
    return "saved"


def test_rank0_file_failure_raises_on_every_rank(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    assert run_on_ranks(2, _rank0_file_failure, str(blocker)) == [
        "save_checkpoint failed while preparing on rank 0"
    ] * 2


def _bad_full_state_dict() -> str:
    from fsdp_compose import load_full_state_dict

    model, _ = _setup()
    try:
        load_full_state_dict(model, ["not", "a", "dict"] if dist.get_rank() == 0 else None)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_load_full_state_dict_bad_input_raises_on_every_rank():
    assert run_on_ranks(2, _bad_full_state_dict) == ["load_full_state_dict: rank 0 needs a dict, got list"] * 2
