"""save_pretrained cuts its files as transformers 5 does: huggingface_hub's splitter and size parser when the hf
extra is installed, and without it a cut of our own that gives the same files (a tensor larger than the limit
alone, before the file being filled), checked against huggingface_hub's on many sizes. Binary units
(``"2GiB"``, which huggingface_hub refuses) and byte counts are read here; what is no size is refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdp_compose.extras.pretrained import file_split
from fsdp_compose.extras.pretrained.file_split import split_into_files
from fsdp_compose.extras.pretrained.model_tensors import ModelTensor


def _tensors(sizes: list[int]) -> list[ModelTensor]:
    return [ModelTensor([f"t{i}"], torch.empty(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]


def _names(files: list[list[ModelTensor]]) -> list[list[str]]:
    return [[t.names[0] for t in members] for members in files]


CASES = [([6, 6, 2, 6, 2, 2], 10), ([2, 12, 3], 10), ([12], 10), ([3, 3, 3, 3], 6), ([1] * 7, 3), ([10, 10], 10), ([11, 1, 11, 1], 10)]


def test_our_cut_is_huggingface_hubs(monkeypatch) -> None:
    pytest.importorskip("huggingface_hub")
    for sizes, limit in CASES + [(list(p), 7) for p in itertools.product((1, 4, 8), repeat=4)]:
        tensors = _tensors(sizes)
        theirs = _names(split_into_files(tensors, limit))
        with monkeypatch.context() as m:
            m.setattr(file_split, "split_state_dict_into_shards_factory", None)
            assert _names(split_into_files(tensors, limit)) == theirs, (sizes, limit)


def test_sizes_read_as_transformers_reads_them_plus_binary_units(monkeypatch) -> None:
    tensors = _tensors([600, 600, 600])
    for fallback in (False, True):
        with monkeypatch.context() as m:
            if fallback or file_split.split_state_dict_into_shards_factory is None:
                m.setattr(file_split, "split_state_dict_into_shards_factory", None)
            assert len(split_into_files(tensors, "1.2KB")) == 2  # 1200 bytes: two tensors, then one
            assert len(split_into_files(tensors, "1KiB")) == 3
            assert len(split_into_files(tensors, " 5gb ")) == 1
            assert len(split_into_files(tensors, "1000")) == 3
            with pytest.raises(ValueError, match="save_pretrained: max_shard_size 'five GB' is not a size"):
                split_into_files(tensors, "five GB")


def test_the_files_transformers_writes(tmp_path) -> None:
    """The same model and size: the same numbered files, each with the same tensors, as transformers' save."""
    transformers = pytest.importorskip("transformers")
    import json

    from fsdp_compose import save_pretrained

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    save_pretrained(model, str(tmp_path / "ours"), max_shard_size="20KB", progress=False)
    maps = [json.loads((tmp_path / d / "model.safetensors.index.json").read_text())["weight_map"] for d in ("theirs", "ours")]
    assert maps[0] == maps[1] and len(set(maps[0].values())) > 2
