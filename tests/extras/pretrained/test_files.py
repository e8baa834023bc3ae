"""load_pretrained refuses bad checkpoints before writing anything, naming the file and the tensor.

Each file here is crafted byte by byte: truncated, offsets beyond the file or overlapping, a shape that does
not match its byte count, a header too large to be real, a dtype safetensors does not define, a shape unlike
the parameter's, and files that lie outside the checkpoint directory (never opened). On 2 ranks, a file bad on
one rank only raises on both, and neither model changes.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import PretrainedCheckpointError, load_pretrained
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
    assert_expected_inline(_error(tmp_path, str(tmp_path / "garbage.safetensors")), """<dir>/garbage.safetensors: the header is not JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)""")


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
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/model.safetensors.index.json: file '../outside.safetensors' lies outside the checkpoint directory <dir>/ckpt; refused""")
    os.symlink(outside, checkpoint / "linked.safetensors")
    index = {"weight_map": {"weight": "linked.safetensors", "bias": "linked.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/model.safetensors.index.json: file 'linked.safetensors' lies outside the checkpoint directory <dir>/ckpt; refused""")
    index = {"weight_map": {"weight": "/etc/hostname"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_expected_inline(_error(tmp_path, str(checkpoint)), """<dir>/ckpt/model.safetensors.index.json: file '/etc/hostname' lies outside the checkpoint directory <dir>/ckpt; refused""")


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
