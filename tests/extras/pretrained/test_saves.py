"""save_pretrained writes a fresh directory beside the target and swaps it in: old or new, never a mix (issue 56).

Crafted as an attacker or an accident would: links planted in the target named like the files a save writes
(``model.safetensors``, the index), or the target itself a link; a save killed at each write point (``os._exit``
in a forked process: rows half written, every file written but nothing swapped, the target's other files being
carried over, right after the swap, and between the two renames where a file system cannot swap); a full disk
on one rank of two; saving over an earlier save of the other shape. Each leaves the old checkpoint or the new
one at the target, never a mix, never writes outside it, never leaves a stale index or ``model.safetensors``
(so transformers, which prefers ``model.safetensors``, and ``load_pretrained`` read the same weights), and keeps
the target's other files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from unittest import mock

import pytest
import torch
from torch import nn

from fsdp_compose import PretrainedCheckpointError, load_pretrained, save_pretrained
from fsdp_compose.extras.pretrained import save as save_module
from fsdp_compose.extras.pretrained import save_dir
from tests.harness import hang_timeout, run_on_ranks

SHARDED = 100  # bytes a file: the model below in 3 files


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))


def _which(path: str, old: nn.Module, new: nn.Module) -> str:
    """Whose values the checkpoint at ``path`` holds: "old", "new", "a mix", or why it does not load."""
    fresh = _model(99)
    try:
        load_pretrained(fresh, path)
    except PretrainedCheckpointError as error:
        return str(error).split(": ", 1)[1]
    state = fresh.state_dict()
    for name, model in (("old", old), ("new", new)):
        if all(torch.equal(state[k], v) for k, v in model.state_dict().items()):
            return name
    return "a mix"


def _weights(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json")))


def test_links_planted_in_the_target_are_never_written_through(tmp_path, monkeypatch) -> None:
    target, outside = str(tmp_path / "ckpt"), tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    save_pretrained(_model(0), target)
    os.remove(f"{target}/model.safetensors")
    os.symlink(outside, f"{target}/model.safetensors")
    new = _model(1)
    save_pretrained(new, target)
    assert outside.read_bytes() == b"not yours"
    assert not os.path.islink(f"{target}/model.safetensors") and _which(target, _model(0), new) == "new"
    os.symlink(outside, f"{target}/model.safetensors.index.json")
    save_pretrained(new, target, max_shard_size=SHARDED)
    assert outside.read_bytes() == b"not yours" and not os.path.islink(f"{target}/model.safetensors.index.json")
    assert _weights(target) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    os.symlink(target, tmp_path / "link")
    with pytest.raises(PretrainedCheckpointError, match=r"link: a symbolic link; save_pretrained replaces the directory"):
        save_pretrained(_model(2), str(tmp_path / "link"))
    assert _which(target, _model(0), new) == "new"
    monkeypatch.chdir(target)  # a save replaces the directory whole: never the one a process works in
    with pytest.raises(PretrainedCheckpointError, match=r"^save_pretrained: \.: holds the working directory"):
        save_pretrained(_model(2), ".")


def _exit_after(real, calls: int = 1):
    """``real``, then the process dies (``os._exit``) once it has run ``calls`` times."""
    count = [0]

    def run_then_die(*args, **kwargs):
        result = real(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            os._exit(0)
        return result

    return run_then_die


KILL_POINTS = {
    # some of the new rows written into the first file, nothing else
    "rows": lambda: mock.patch.object(save_module, "pwrite_all", _exit_after(save_module.pwrite_all, 2)),
    # every file and the index written; nothing swapped
    "written": lambda: mock.patch.object(save_module, "_write_index", _exit_after(save_module._write_index)),
    # the target's other files linked into the new directory; nothing swapped
    "carried": lambda: mock.patch.object(save_dir, "_carry_over", _exit_after(save_dir._carry_over)),
    # the new directory swapped in; the old one not yet removed
    "swapped": lambda: mock.patch.object(save_dir, "_swap", _exit_after(save_dir._swap)),
    # a file system that cannot swap two directories: killed between its two renames
    "between-renames": lambda: _between_renames(),
}


@contextlib.contextmanager
def _between_renames():
    with mock.patch.object(save_dir, "_renameat2", None), mock.patch.object(os, "rename", _exit_after(os.rename)):
        yield


def _killed_save(target: str, new: nn.Module, point: str) -> int:
    """Fork; the child saves ``new`` over ``target`` and dies at ``point``; the child's exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            with KILL_POINTS[point]():
                save_pretrained(new, target, max_shard_size=SHARDED)
        finally:
            os._exit(3)  # reached only if the save did not die where it should
    deadline = time.monotonic() + hang_timeout()
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the save killed at {point} hung")


def test_a_save_killed_at_each_write_point_leaves_the_old_checkpoint_or_the_new(tmp_path) -> None:
    old, new = _model(0), _model(1)
    found = {}
    for point in KILL_POINTS:
        target = str(tmp_path / point)
        save_pretrained(old, target, max_shard_size=SHARDED)  # 3 files named as the new save names its own
        assert _killed_save(target, new, point) == 0, point
        left = sorted(n.replace(point, "T").split("-", 1)[0] for n in os.listdir(tmp_path) if point in n and n != point)
        found[point] = (_which(target, old, new), left)
    assert found == {
        "rows": ("old", [".T.saving"]),
        "written": ("old", [".T.saving"]),
        "carried": ("old", [".T.saving"]),
        "swapped": ("new", [".T.saving"]),  # the old directory, not yet removed: never read
        "between-renames": ("no such checkpoint file or directory", [".T.saving", ".T.saving"]),  # new, and old .replaced
    }, found
    with pytest.warns(UserWarning, match=r"\.swapped\.saving-\w+: left by a save_pretrained that did not finish"):
        save_pretrained(new, str(tmp_path / "swapped"))


def test_saving_over_an_earlier_save_leaves_no_stale_weights_and_keeps_other_files(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    save_pretrained(_model(0), target)
    with open(f"{target}/tokenizer.json", "w") as f:
        f.write("{}")
    os.mkdir(f"{target}/original")
    with open(f"{target}/original/params.json", "w") as f:
        f.write("{}")
    os.chmod(target, 0o750)
    shapes = []
    for seed, size in ((1, SHARDED), (2, "5GB"), (3, SHARDED)):
        model = _model(seed)
        save_pretrained(model, target, max_shard_size=size)
        shapes.append(_weights(target))
        assert _which(target, _model(0), model) == "new", seed
    single, sharded = ["model.safetensors"], [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    assert shapes == [sharded + ["tokenizer.json"], single + ["tokenizer.json"], sharded + ["tokenizer.json"]]
    assert os.path.exists(f"{target}/original/params.json") and stat.S_IMODE(os.stat(target).st_mode) == 0o750
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing left beside it


def _full_disk(base: str, shared: bool) -> dict:
    """Rank ``1 if shared else 0`` runs out of space mid-save: every rank raises the same error, the target
    keeps the old checkpoint, and nothing is left beside it."""
    import torch.distributed as dist

    from fsdp_compose import fully_shard

    target = os.path.join(base, f"shared-{shared}")
    old = _model(0)
    save_pretrained(old, target)
    new = _model(1)
    fully_shard(new)
    real = save_module.pwrite_all

    def no_space(fd, data, offset):
        if dist.get_rank() == (1 if shared else 0) and offset > 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    with mock.patch.object(save_module, "pwrite_all", no_space):
        try:
            save_pretrained(new, target, shared_filesystem=shared)
            message = "saved"
        except PretrainedCheckpointError as error:
            message = str(error).replace(base, "<dir>")
    dist.barrier()
    fresh = _model(99)
    load_pretrained(fresh, target)
    kept = all(torch.equal(fresh.state_dict()[k], v) for k, v in old.state_dict().items())
    return {"message": message, "kept": kept, "beside": sorted(n for n in os.listdir(base) if f"shared-{shared}" in n)}


@pytest.mark.parametrize("shared", [True, False])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_old_checkpoint(tmp_path, shared) -> None:
    results = run_on_ranks(2, _full_disk, str(tmp_path), shared, timeout=120)
    assert results[0] == results[1], results
    r = results[0]
    assert r["kept"] and r["beside"] == [f"shared-{shared}"], r
    rank = 1 if shared else 0
    assert r["message"].startswith(f"save_pretrained to <dir>/shared-{shared} failed; it was left as it was: <dir>/.shared-{shared}.saving-"), r
    assert r["message"].endswith(f"/model.safetensors: OSError: No space left on device (rank {rank})"), r
