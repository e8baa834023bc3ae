"""load_pretrained refuses bad checkpoints before writing anything, naming the file and the tensor.

Each file here is crafted byte by byte: truncated, offsets beyond the file or overlapping, a shape that does
not match its byte count, a header too large to be real, a dtype safetensors does not define, a shape unlike
the parameter's, and files that lie outside the checkpoint directory (never opened). On 2 ranks, a file bad on
one rank only raises on both, and neither model changes.

Issue 56's round (the file layer of ``extras/checkpoint`` under the loader): on 2 ranks, a tensor file swapped
for a link, a FIFO or a shorter file after the checks, an index that is a link out of the directory, a 512 MiB
sparse index: each refused on every rank, with the same message naming the file, within seconds, in bounded
memory, the model untouched and nothing outside ever read. Headers safetensors' own reader refuses (a name
twice, UTF-16, ``__metadata__`` not an object of strings, deep JSON, gaps, trailing bytes) are refused here too,
by message, never a ``RecursionError``; and every refusal pickles, as DCP passes them between ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
from unittest import mock

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import CheckpointError, PretrainedCheckpointError, load_pretrained
from fsdp_compose.extras.checkpoint.files import FileRefused
from fsdp_compose.extras.pretrained import load as load_module
from fsdp_compose.extras.pretrained.local_region import Region
from tests.harness import run_on_ranks

WEIGHT, BIAS = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0])


def _file(path: str, header: dict, data: bytes, length: int | None = None) -> str:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _good_header() -> dict:
    return {
        "weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "bias": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]},
    }


def _data() -> bytes:
    return WEIGHT.numpy().tobytes() + BIAS.numpy().tobytes()


def _error(tmp_path, path: str) -> str:
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedCheckpointError) as caught:
        load_pretrained(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model changed"
    return str(caught.value).replace(str(tmp_path), "<dir>")


def test_a_good_file_loads(tmp_path) -> None:
    model = nn.Linear(3, 2)
    result = load_pretrained(model, _file(str(tmp_path / "m.safetensors"), _good_header(), _data()))
    assert torch.equal(model.weight, WEIGHT) and torch.equal(model.bias, BIAS)
    assert result.bytes_read == 32 and result.missing_keys == [] and result.unexpected_keys == []


def test_truncated_file(tmp_path) -> None:
    path = _file(str(tmp_path / "m.safetensors"), _good_header(), _data()[:28])
    assert_expected_inline(_error(tmp_path, path), """<dir>/m.safetensors: tensor 'bias': data_offsets [24, 32] end at byte 176, beyond the file's 172 bytes (truncated?)""")
    with open(tmp_path / "short.safetensors", "wb") as f:
        f.write(b"\x05\x00")
    assert_expected_inline(_error(tmp_path, str(tmp_path / "short.safetensors")), """<dir>/short.safetensors: truncated: 2 bytes, fewer than the 8 of a header length""")
    _file(str(tmp_path / "cut.safetensors"), _good_header(), b"", length=4000)
    assert_expected_inline(_error(tmp_path, str(tmp_path / "cut.safetensors")), """<dir>/cut.safetensors: truncated: the header needs 4008 bytes, the file has 144""")


def test_offsets_that_lie(tmp_path) -> None:
    header = _good_header()
    header["bias"] = {"dtype": "F32", "shape": [244], "data_offsets": [24, 1000]}
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "beyond.safetensors"), header, _data())), """<dir>/beyond.safetensors: tensor 'bias': data_offsets [24, 1000] end at byte 1148, beyond the file's 180 bytes (truncated?)""")
    header = _good_header()
    header["bias"] = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "overlap.safetensors"), header, _data())), """<dir>/overlap.safetensors: tensors 'weight' and 'bias' overlap (bytes 144-168 and 160-168)""")
    header = _good_header()
    header["weight"] = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "count.safetensors"), header, _data())), """<dir>/count.safetensors: tensor 'weight': shape [2, 3] of F32 needs 24 bytes, data_offsets [0, 20] hold 20""")
    header = _good_header()
    header["weight"]["data_offsets"] = [24, 0]
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "reversed.safetensors"), header, _data())), """<dir>/reversed.safetensors: tensor 'weight': data_offsets [24, 0] are not [begin, end] with 0 <= begin <= end""")


def test_header_too_large_or_not_json(tmp_path) -> None:
    path = _file(str(tmp_path / "huge.safetensors"), _good_header(), _data(), length=2**40)
    assert_expected_inline(_error(tmp_path, path), """<dir>/huge.safetensors: header length 1099511627776 is too large to be real (limit 104857600)""")
    with open(tmp_path / "garbage.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 4) + b"\xff{x}" + _data())
    assert_expected_inline(_error(tmp_path, str(tmp_path / "garbage.safetensors")), """<dir>/garbage.safetensors: the header is refused: not UTF-8 ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)""")


def test_unknown_dtype(tmp_path) -> None:
    header = _good_header()
    header["bias"]["dtype"] = "F7"
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "m.safetensors"), header, _data())), """<dir>/m.safetensors: tensor 'bias': dtype 'F7' is not one safetensors defines and torch has (BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, C64, F8_E4M3, F8_E5M2)""")


def test_shape_unlike_the_parameter(tmp_path) -> None:
    header = _good_header()
    header["weight"]["shape"] = [3, 2]
    assert_expected_inline(_error(tmp_path, _file(str(tmp_path / "m.safetensors"), header, _data())), """<dir>/m.safetensors: tensor 'weight' has shape [3, 2], the model's 'weight' [2, 3]""")


def test_missing_and_unexpected_names(tmp_path) -> None:
    header = {"weight": _good_header()["weight"], "extra": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}
    path = _file(str(tmp_path / "m.safetensors"), header, _data())
    assert_expected_inline(_error(tmp_path, path), """<dir>/m.safetensors: missing from the checkpoint: bias; unexpected (not in the model): extra; pass key_map to rename, or strict=False""")
    model = nn.Linear(3, 2)
    result = load_pretrained(model, path, strict=False, key_map={"extra": "bias"})
    assert torch.equal(model.bias, BIAS) and result.missing_keys == [] and result.unexpected_keys == []
    result = load_pretrained(model, path, strict=False, key_map=lambda name: None if name == "extra" else name)
    assert result.missing_keys == ["bias"] and result.unexpected_keys == []


def test_files_outside_the_directory_are_never_opened(tmp_path) -> None:
    outside = _file(str(tmp_path / "outside.safetensors"), _good_header(), _data())
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    index = {"weight_map": {"weight": "../outside.safetensors", "bias": "../outside.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/model.safetensors.index.json: file '../outside.safetensors' is not a file name in the checkpoint directory <dir>/ckpt (a path); refused, never opened""")
    os.symlink(outside, checkpoint / "linked.safetensors")
    index = {"weight_map": {"weight": "linked.safetensors", "bias": "linked.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/linked.safetensors: a symbolic link, not a regular file; never opened (a Hugging Face cache snapshot links its files: snapshot_download(..., local_dir=d) writes them)""")
    index = {"weight_map": {"weight": "/etc/hostname"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/model.safetensors.index.json: file '/etc/hostname' is not a file name in the checkpoint directory <dir>/ckpt (a path); refused, never opened""")


def test_byte_runs_of_a_box_match_slicing() -> None:
    full = torch.arange(4 * 5 * 6).view(4, 5, 6)
    for box in [((1, 2), (0, 5), (0, 6)), ((0, 4), (2, 2), (0, 6)), ((1, 3), (0, 5), (4, 2)), ((0, 4), (0, 5), (0, 6))]:
        region = Region((4, 5, 6), box, writer=True)
        flat = full.view(-1)
        got = torch.cat([flat[start // 8 : (start + n) // 8] for start, _, n in region.runs(8)])
        want = full[tuple(slice(s, s + n) for s, n in box)].reshape(-1)
        assert torch.equal(got, want), box


def _one_rank_bad(base: str) -> list[str]:
    import torch.distributed as dist

    from fsdp_compose import fully_shard

    rank = dist.get_rank()
    path = os.path.join(base, f"rank{rank}.safetensors")  # node-local copies: rank 1's is truncated
    _file(path, _good_header(), _data() if rank == 0 else _data()[:20])
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    fully_shard(model)
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        load_pretrained(model, path)
    except PretrainedCheckpointError as error:
        unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        return [str(error).replace(base, "<dir>"), unchanged]
    return ["no error", True]


def test_a_file_bad_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    results = run_on_ranks(2, _one_rank_bad, str(tmp_path))
    assert results[0] == results[1], results
    assert results[0][1], "a model changed"
    assert_expected_inline(results[0][0], """<dir>/rank1.safetensors: tensor 'weight': data_offsets [0, 24] end at byte 168, beyond the file's 164 bytes (truncated?) (rank 1)""")


class _WithTable(nn.Module):
    """A linear layer and a non-persistent buffer its __init__ computes (like a rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("table", torch.arange(4.0) / 4, persistent=False)

    def init_table(self) -> None:
        self.table.copy_(torch.arange(4.0) / 4)


def test_meta_model_buffers_computed_by_init_buffers(tmp_path) -> None:
    header = {f"linear.{k}": v for k, v in _good_header().items()}
    path = _file(str(tmp_path / "m.safetensors"), header, _data())
    with torch.device("meta"):
        model = _WithTable()
    with pytest.raises(PretrainedCheckpointError) as caught:
        load_pretrained(model, path)
    assert_expected_inline(str(caught.value), """non-persistent buffers table are on meta and no checkpoint holds them; pass init_buffers=fn(module) that computes them (what the module's __init__ does)""")
    assert model.linear.weight.is_meta  # nothing was written or materialized
    load_pretrained(model, path, init_buffers=lambda module: module.init_table())  # called for the module owning it
    assert torch.equal(model.table, torch.arange(4.0) / 4) and torch.equal(model.linear.weight, WEIGHT)


# ----- issue 56: the checkpoint file layer under load_pretrained --------------------------------
def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))


def _outside_file(path: str) -> str:
    """A valid checkpoint outside every case's directory, with other values: loading it would show."""
    header = _good_header()
    return _file(path, header, torch.full((2, 3), 99.0).numpy().tobytes() + torch.full((2,), 99.0).numpy().tobytes())


def _change(how: str, file: str, outside: str) -> None:
    """What is done to ``file``: swapped for a link out or for a FIFO, or cut 8 bytes short."""
    if how == "truncate":
        os.truncate(file, os.path.getsize(file) - 8)
        return
    os.remove(file)
    os.symlink(outside, file) if how == "link" else os.mkfifo(file)


# case -> (when the file is changed, how): after every rank passed the checks; after the last check, before
# the first read (read short: said on every rank); before the load
CHANGES = {
    "link-after-check": ("after-check", "link"),
    "fifo-after-check": ("after-check", "fifo"),
    "truncated-after-check": ("after-check", "truncate"),
    "truncated-while-read": ("before-read", "truncate"),
    "link-while-read": ("before-read", "link"),  # read from the descriptor checked: the original values load
    "tensor-file-link": ("before", "link"),
    "tensor-file-fifo": ("before", "fifo"),
}


def _craft_load_cases(base: str) -> dict[str, str]:
    """Each case's checkpoint directory (rank 0 crafts them)."""
    outside = _outside_file(os.path.join(base, "outside.safetensors"))
    cases = {}
    for name in [*CHANGES, "index-link-out", "sparse-index"]:
        cases[name] = c = os.path.join(base, name)
        os.mkdir(c)
        _file(f"{c}/model.safetensors", _good_header(), _data())
        if CHANGES.get(name, ("",))[0] == "before":
            _change(CHANGES[name][1], f"{c}/model.safetensors", outside)
    c = cases["index-link-out"]
    os.rename(f"{c}/model.safetensors", f"{c}/w.safetensors")
    with open(os.path.join(base, "outside.index.json"), "w") as f:
        json.dump({"weight_map": {"weight": "w.safetensors", "bias": "w.safetensors"}}, f)
    os.symlink(os.path.join(base, "outside.index.json"), f"{c}/model.safetensors.index.json")
    c = cases["sparse-index"]
    os.rename(f"{c}/model.safetensors", f"{c}/w.safetensors")
    with open(f"{c}/model.safetensors.index.json", "w") as f:
        f.write('{"weight_map": {"weight": "w.safetensors", "bias": "w.safetensors"}}')
    os.truncate(f"{c}/model.safetensors.index.json", 512 << 20)  # sparse: no disk, 512 MiB if read
    return cases


def _load_cases(base: str) -> dict:
    import torch.distributed as dist

    from fsdp_compose import fully_shard

    listing = [_craft_load_cases(base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    fully_shard(model)
    real_open, real_materialize = load_module.open_checkpoint, load_module._materialize
    out: dict = {}
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # peak RSS from here
    baseline = _peak_rss()
    for name, path in listing[0].items():
        when, how = CHANGES.get(name, ("before", None))

        def change_at(point: str, how=how, path=path) -> None:
            dist.barrier()  # every rank got here; then rank 0 changes the file
            if point == when and dist.get_rank() == 0:
                _change(how, f"{path}/model.safetensors", os.path.join(base, "outside.safetensors"))
            dist.barrier()

        def opened_then_changed(where: str):
            checkpoint = real_open(where)
            change_at("after-check")
            return checkpoint

        def changed_then_materialized(*args):
            change_at("before-read")
            return real_materialize(*args)

        before = [p.to_local().clone() for p in model.parameters()]
        start = time.perf_counter()
        with (
            mock.patch.object(load_module, "open_checkpoint", opened_then_changed if when == "after-check" else real_open),
            mock.patch.object(load_module, "_materialize", changed_then_materialized if when == "before-read" else real_materialize),
        ):
            try:
                load_pretrained(model, path)
                message = "loaded"
            except PretrainedCheckpointError as error:
                message = str(error).replace(base, "<dir>")
        seconds = time.perf_counter() - start
        dist.barrier()
        unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        values = [p.full_tensor() for p in model.parameters()]
        original = torch.equal(values[0], WEIGHT) and torch.equal(values[1], BIAS)
        out[name] = {"message": message, "seconds": seconds, "unchanged": unchanged, "original": original}
        if message == "loaded":
            model.reset_parameters()
    out["peak_growth"] = _peak_rss() - baseline
    return out


def test_files_changed_after_the_checks_links_fifos_and_huge_indexes_are_refused_on_every_rank(tmp_path) -> None:
    results = run_on_ranks(2, _load_cases, str(tmp_path), timeout=240)
    first = results[0]
    for rank, out in enumerate(results):
        assert out["peak_growth"] < (32 << 20), (rank, out["peak_growth"])  # the 512 MiB index never read
        for name, case in out.items():
            if name == "peak_growth":
                continue
            assert case["message"] == first[name]["message"], (name, rank, case, first[name])
            assert case["seconds"] < 30, (name, rank, case["seconds"])
            assert case["unchanged"] or name.endswith("while-read"), (name, rank)
    assert first["link-while-read"]["original"], "what the link points at was read"
    messages = "\n".join(f"{name}: {case['message']}" for name, case in first.items() if name != "peak_growth")
    assert_expected_inline(messages, """\
link-after-check: <dir>/link-after-check/model.safetensors: replaced by a symbolic link since it was checked; never read through it; nothing was loaded (rank 0 and 1 other rank(s))
fifo-after-check: <dir>/fifo-after-check/model.safetensors: replaced by a FIFO since it was checked; never read through it; nothing was loaded (rank 0 and 1 other rank(s))
truncated-after-check: <dir>/truncated-after-check/model.safetensors: 168 bytes now, 176 when it was checked (truncated or rewritten); nothing was loaded (rank 0 and 1 other rank(s))
truncated-while-read: <dir>/truncated-while-read/model.safetensors: ended at byte 168, short of the 176 it held when checked (truncated); the model holds part of the checkpoint: load it again (rank 0 and 1 other rank(s))
link-while-read: loaded
tensor-file-link: <dir>/tensor-file-link/model.safetensors: a symbolic link, not a regular file; never opened (a Hugging Face cache snapshot links its files: snapshot_download(..., local_dir=d) writes them) (rank 0 and 1 other rank(s))
tensor-file-fifo: <dir>/tensor-file-fifo/model.safetensors: a FIFO, not a regular file; never opened (rank 0 and 1 other rank(s))
index-link-out: <dir>/index-link-out/model.safetensors.index.json: a symbolic link, not a regular file; never opened (a Hugging Face cache snapshot links its files: snapshot_download(..., local_dir=d) writes them) (rank 0 and 1 other rank(s))
sparse-index: <dir>/sparse-index/model.safetensors.index.json: 536870912 bytes, more than the 67108864 such a file holds (rank 0 and 1 other rank(s))""")


def _raw_file(path: str, text: bytes, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return path


def test_headers_safetensors_refuses_are_refused_here_by_message(tmp_path) -> None:
    """What safetensors' own reader refuses (``safe_open``) is refused here too, naming the file; deep JSON
    never escapes as a ``RecursionError``. A name twice: safetensors keeps the last; here, refused."""
    safetensors = pytest.importorskip("safetensors")
    good = json.dumps(_good_header())
    w = json.dumps(_good_header()["weight"])
    cases = {
        "twice": (f'{{"weight":{w},"weight":{w},"bias":{json.dumps(_good_header()["bias"])}}}'.encode(), _data()),
        "utf16": (good.encode("utf-16"), _data()),
        "metadata-array": (f'{{"__metadata__":["pt"],{good[1:]}'.encode(), _data()),
        "metadata-not-strings": (f'{{"__metadata__":{{"format":1}},{good[1:]}'.encode(), _data()),
        "deep-metadata": (f'{{"__metadata__":{{"a":{"[" * 100_000}{"]" * 100_000}}},{good[1:]}'.encode(), _data()),
        "deep-shape": (good.replace("[2, 3]", "[" * 70 + "]" * 70, 1).encode(), _data()),  # 70 deep: Python parses it
        "gap": (json.dumps({"weight": _good_header()["weight"], "bias": {"dtype": "F32", "shape": [2], "data_offsets": [28, 36]}}).encode(), _data() + bytes(4)),
        "trailing": (good.encode(), _data() + bytes(8)),
    }
    messages = []
    for name, (text, data) in cases.items():
        path = _raw_file(str(tmp_path / f"{name}.safetensors"), text, data)
        messages.append(f"{name}: {_error(tmp_path, path)}")
        if name != "twice":  # safetensors keeps the last of two names; refused then only by their offsets
            with pytest.raises(safetensors.SafetensorError):
                safetensors.safe_open(path, "pt")
    assert_expected_inline("\n".join(messages), """\
twice: <dir>/twice.safetensors: the header is refused: name 'weight' appears twice in one object (which one is meant?)
utf16: <dir>/utf16.safetensors: the header is refused: not UTF-8 ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)
metadata-array: <dir>/metadata-array.safetensors: '__metadata__' must be an object mapping names to strings, not an array
metadata-not-strings: <dir>/metadata-not-strings.safetensors: '__metadata__' must be an object mapping names to strings, not an object holding more than strings
deep-metadata: <dir>/deep-metadata.safetensors: the header is refused: nested more than 64 deep
deep-shape: <dir>/deep-shape.safetensors: the header is refused: nested more than 64 deep
gap: <dir>/gap.safetensors: bytes 168-172 belong to no tensor (safetensors lays tensors back to back)
trailing: <dir>/trailing.safetensors: 8 bytes after the last tensor's end (byte 176), which safetensors' reader refuses""")


def test_every_refusal_pickles() -> None:
    """DCP passes a rank's failure to the others pickled: each error comes back whole."""
    for error in (FileRefused("/d/f", "a FIFO, not a regular file"), CheckpointError("x"), PretrainedCheckpointError("y")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.args == error.args
    refused = pickle.loads(pickle.dumps(FileRefused("/d/f", "why")))
    assert (refused.path, refused.reason) == ("/d/f", "why")

def test_saved_files_are_what_safetensors_writes(tmp_path) -> None:
    """save_pretrained's files, byte for byte what ``safetensors.torch.save`` writes for the same tensors: its
    layout (widest dtype first, then by name), so every tensor starts at a multiple of its element size, and
    ``safe_open`` reads each back."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    from fsdp_compose import save_pretrained

    model = nn.Module()
    for name, value in {
        "flag": torch.tensor([True, False, True]),
        "b16": torch.arange(5, dtype=torch.bfloat16),
        "count": torch.arange(3, dtype=torch.int64),
        "w": torch.arange(6.0).view(2, 3),
        "byte": torch.arange(7, dtype=torch.uint8),
        "h": torch.arange(3, dtype=torch.float16),
    }.items():
        model.register_buffer(name, value)
    save_pretrained(model, str(tmp_path / "out"))
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == safetensors_torch.save(dict(model.state_dict()), metadata={"format": "pt"})
    length = struct.unpack("<Q", ours[:8])[0]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        for name, value in model.state_dict().items():
            assert torch.equal(f.get_tensor(name), value), name
    for name, entry in json.loads(ours[8 : 8 + length]).items():
        if name != "__metadata__":
            assert (8 + length + entry["data_offsets"][0]) % model.state_dict()[name].element_size() == 0, name
