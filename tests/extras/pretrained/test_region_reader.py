"""A rank's region of a file tensor read into its local shard: straight in (same dtype), through the reused
scratch buffer chunk by chunk (another dtype; chunks smaller than a run and than an element row here), or
whole into a strided local tensor; each equal to slicing the file's tensor and converting it."""

from __future__ import annotations

import pytest
import torch

from fsdp_compose.extras.pretrained import region_reader
from fsdp_compose.extras.pretrained.checkpoint_dir import open_checkpoint
from fsdp_compose.extras.pretrained.local_region import Region
from fsdp_compose.extras.pretrained.region_reader import RegionReader

BOXES = [((0, 7), (0, 5)), ((2, 3), (0, 5)), ((2, 3), (1, 3)), ((6, 1), (4, 1)), ((3, 0), (0, 5))]


def test_regions_read_equal_slicing_in_every_way(tmp_path, monkeypatch) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    values = torch.randn(7, 5).to(torch.bfloat16)
    safetensors_torch.save_file({"w": values}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(region_reader, "CHUNK", 6)  # 3 bf16 elements a read: runs of 5 or 3 cut across chunks
    reader = RegionReader()
    with open_checkpoint(str(tmp_path)) as checkpoint:
        entry = checkpoint.tensors["w"]
        for box in BOXES:
            expected = values[tuple(slice(start, start + size) for start, size in box)]
            region = Region((7, 5), box, writer=True)
            shape = region.local_shape
            same, converted = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.float32)
            strided = torch.empty(shape[::-1], dtype=torch.float32).t()
            for local in (same, converted, strided):
                assert reader.read_into(local, entry, region) == expected.numel() * 2, box
                assert torch.equal(local, expected.to(local.dtype)), (box, local.dtype, local.is_contiguous())
