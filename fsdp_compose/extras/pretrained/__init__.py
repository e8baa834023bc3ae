"""Hugging Face safetensors checkpoints read straight into shards and written straight out of them.

``load_pretrained`` reads only each rank's rows; ``save_pretrained`` writes each rank's rows at their byte
offsets. The safetensors format is parsed here (``safetensors_file.py``), with no dependency.
"""

from .load import LoadResult, load_pretrained
from .safetensors_file import PretrainedCheckpointError
from .save import save_pretrained

__all__ = ["load_pretrained", "save_pretrained", "LoadResult", "PretrainedCheckpointError"]
