"""A tensor described by where its elements come from, for the conversions transformers applies between a
checkpoint's layout and a model's (``conversions.py``): one tensor per expert on disk, one fused 3-D parameter
in the model, and back.

transformers' conversion operations (``MergeModulelist``, ``Concatenate``, ``Chunk``, ``SplitModulelist``,
``Transpose``, ...) run unchanged on ``Layout`` objects instead of tensors: the torch functions they call
(``stack``, ``cat``, ``chunk``, ``split``, ``narrow``, ``transpose``, ``squeeze``, ``contiguous``) build a tree
and move no data. ``pieces(box)`` then says, for a box of the result (a rank's shard), which box of which
source each part comes from: a rank reads only the sources of its own rows (the experts it holds), or writes
only the parts of a checkpoint tensor it holds. Any other torch function raises ``_UnsupportedConversion``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

Box = tuple[tuple[int, int], ...]  # (start, size) per dim


class _UnsupportedConversion(TypeError):
    """A conversion operation called a torch function a ``Layout`` cannot describe without the values."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements of the result's ``box`` taken from ``source_box`` of the source ``source``. ``dims`` gives, per
    dim of the result, the source dim it runs along (``None``: a dim of size 1 the source lacks); the source's
    dims that no result dim runs along have size 1 in ``source_box``."""

    source: str
    source_box: Box
    box: Box
    dims: tuple[int | None, ...]

    def arrange(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` (the values of ``source_box``, in the source's dims) in the result's dims (``box``'s shape)."""
        runs_along = [d for d in self.dims if d is not None]
        rest = [d for d in range(len(self.source_box)) if d not in runs_along]
        return data.permute(*runs_along, *rest).reshape([size for _, size in self.box])

    def within(self, region: Box) -> Piece | None:
        """The part of this piece whose source elements lie in ``region`` (a box of the source), or ``None``."""
        source_box = []
        for (start, size), (r_start, r_size) in zip(self.source_box, region):
            low, high = max(start, r_start), min(start + size, r_start + r_size)
            if high <= low:
                return None
            source_box.append((low, high - low))
        box = list(self.box)
        for k, d in enumerate(self.dims):
            if d is not None:
                box[k] = (box[k][0] + source_box[d][0] - self.source_box[d][0], source_box[d][1])
        return Piece(self.source, tuple(source_box), tuple(box), self.dims)


def slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor holding the box ``origin``."""
    return tuple(slice(start - o, start - o + size) for (start, size), (o, _) in zip(box, origin))


def full_box(shape) -> Box:
    return tuple((0, s) for s in shape)


class Layout:
    """Tensor-like enough for transformers' conversion operations: a shape, and the functions listed above."""

    shape: torch.Size

    def pieces(self, box: Box) -> list[Piece]:
        """Where the elements of ``box`` come from, one ``Piece`` per source box."""
        if any(size == 0 for _, size in box):
            return []
        return self._pieces(box)

    def _pieces(self, box: Box) -> list[Piece]:
        raise NotImplementedError

    # what the operations call on a tensor
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self, *args, **kwargs) -> Layout:
        return self

    def squeeze(self, dim: int) -> Layout:
        dim = _dim(dim, self.ndim)
        return _Squeeze(self, dim) if self.shape[dim] == 1 else self

    def transpose(self, dim0: int, dim1: int) -> Layout:
        return _Transpose(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))

    def narrow(self, dim: int, start: int, length: int) -> Layout:
        return _Narrow(self, _dim(dim, self.ndim), start, length)

    def chunk(self, chunks: int, dim: int = 0) -> list[Layout]:
        dim = _dim(dim, self.ndim)
        step = -(-self.shape[dim] // chunks) if self.shape[dim] else 0
        return self.split(step, dim) if step else [self]

    def split(self, sizes, dim: int = 0) -> list[Layout]:
        dim = _dim(dim, self.ndim)
        total = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, total - start) for start in range(0, total, sizes)]
        if sum(sizes) != total:
            raise ValueError(f"split sizes {list(sizes)} do not add up to dim {dim}'s {total}")
        parts, start = [], 0
        for size in sizes:
            parts.append(_Narrow(self, dim, start, size))
            start += size
        return parts

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack:
            return _Stack(*args, **kwargs)
        if func is torch.cat or func is torch.concat:
            return _Cat(*args, **kwargs)
        methods = {torch.chunk: "chunk", torch.split: "split", torch.narrow: "narrow", torch.transpose: "transpose",
                   torch.squeeze: "squeeze"}
        if func in methods:
            layout, *rest = args
            return getattr(layout, methods[func])(*rest, **kwargs)
        raise _UnsupportedConversion(f"torch.{getattr(func, '__name__', func)}")


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for {ndim} dims")
    return dim % ndim


class Leaf(Layout):
    """A source tensor, by its key (a checkpoint name, or a model name)."""

    def __init__(self, key: str, shape) -> None:
        self.key, self.shape = key, torch.Size(shape)

    def _pieces(self, box: Box) -> list[Piece]:
        return [Piece(self.key, box, box, tuple(range(len(box))))]


class _Stack(Layout):
    def __init__(self, tensors, dim: int = 0) -> None:
        self.children = list(tensors)
        shapes = {tuple(child.shape) for child in self.children}
        if len(shapes) != 1:
            raise ValueError(f"stacking tensors of different shapes {sorted(shapes)}")
        shape = list(shapes.pop())
        self.dim = _dim(dim, len(shape) + 1)
        shape.insert(self.dim, len(self.children))
        self.shape = torch.Size(shape)

    def _pieces(self, box: Box) -> list[Piece]:
        d, (start, size) = self.dim, box[self.dim]
        found = []
        for i in range(start, start + size):
            for p in self.children[i].pieces(box[:d] + box[d + 1 :]):
                box_i, dims_i = p.box[:d] + ((i, 1),) + p.box[d:], p.dims[:d] + (None,) + p.dims[d:]
                found.append(Piece(p.source, p.source_box, box_i, dims_i))
        return found


class _Cat(Layout):
    def __init__(self, tensors, dim: int = 0) -> None:
        self.children = list(tensors)
        first = list(self.children[0].shape)
        self.dim = _dim(dim, len(first))
        for child in self.children:
            other = list(child.shape)
            if len(other) != len(first) or any(a != b for k, (a, b) in enumerate(zip(other, first)) if k != self.dim):
                raise ValueError(f"concatenating tensors of shapes {list(first)} and {other} on dim {self.dim}")
        first[self.dim] = sum(child.shape[self.dim] for child in self.children)
        self.shape = torch.Size(first)

    def _pieces(self, box: Box) -> list[Piece]:
        d, (start, size) = self.dim, box[self.dim]
        found, offset = [], 0
        for child in self.children:
            length = child.shape[d]
            low, high = max(start, offset), min(start + size, offset + length)
            if high > low:
                for p in child.pieces(box[:d] + ((low - offset, high - low),) + box[d + 1 :]):
                    found.append(dataclasses.replace(p, box=_shift(p.box, d, offset)))
            offset += length
        return found


class _Narrow(Layout):
    def __init__(self, child: Layout, dim: int, start: int, length: int) -> None:
        if not 0 <= start <= start + length <= child.shape[dim]:
            raise ValueError(f"narrowing dim {dim} of {list(child.shape)} to [{start}, {start + length})")
        self.child, self.dim, self.start = child, dim, start
        self.shape = torch.Size(child.shape[:dim] + (length,) + child.shape[dim + 1 :])

    def _pieces(self, box: Box) -> list[Piece]:
        d = self.dim
        inner = box[:d] + ((box[d][0] + self.start, box[d][1]),) + box[d + 1 :]
        return [dataclasses.replace(p, box=_shift(p.box, d, -self.start)) for p in self.child.pieces(inner)]


class _Squeeze(Layout):
    def __init__(self, child: Layout, dim: int) -> None:
        self.child, self.dim = child, dim
        self.shape = torch.Size(child.shape[:dim] + child.shape[dim + 1 :])

    def _pieces(self, box: Box) -> list[Piece]:
        d = self.dim
        return [
            dataclasses.replace(p, box=p.box[:d] + p.box[d + 1 :], dims=p.dims[:d] + p.dims[d + 1 :])
            for p in self.child.pieces(box[:d] + ((0, 1),) + box[d:])
        ]


class _Transpose(Layout):
    def __init__(self, child: Layout, dim0: int, dim1: int) -> None:
        self.child, self.swap = child, (dim0, dim1)
        self.shape = torch.Size(_swapped(tuple(child.shape), dim0, dim1))

    def _pieces(self, box: Box) -> list[Piece]:
        return [
            dataclasses.replace(p, box=_swapped(p.box, *self.swap), dims=_swapped(p.dims, *self.swap))
            for p in self.child.pieces(_swapped(box, *self.swap))
        ]


def _shift(box: Box, dim: int, by: int) -> Box:
    return box[:dim] + ((box[dim][0] + by, box[dim][1]),) + box[dim + 1 :]


def _swapped(values: tuple, a: int, b: int) -> tuple:
    values = list(values)
    values[a], values[b] = values[b], values[a]
    return tuple(values)
