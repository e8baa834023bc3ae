"""Muon's math on one whole matrix (or a batch of them), as ``torch.optim.Muon`` computes it.

Kept apart from the owner-computed machinery (``matrix.py``) so the update can be read, and tested bit for
bit against torch's, on its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MUON_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
MOMENTUM = "momentum_buffer"  # torch.optim.Muon's state key


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate orthogonalization ``U V^T`` of ``matrix`` by a quintic Newton-Schulz iteration in bf16.

    Works on the wide orientation (fewer rows than columns) so the Gram matrix is the small one. A 3-D
    ``(E, m, n)`` input is a batch of ``E`` matrices, each iterated on its own with the same 2-D kernels, so
    each equals ``torch.optim.Muon``'s update of that matrix bit for bit (``baddbmm`` rounds differently).
    """
    if matrix.ndim == 3:
        out = torch.empty(matrix.shape, dtype=torch.bfloat16, device=matrix.device)
        for i, one in enumerate(matrix):
            out[i] = newton_schulz(one, coefficients, steps, eps)
        return out
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*G + c*G^2) X
    return x.T if tall else x


def newton_schulz_work(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a ``rows x cols`` matrix, on its wide orientation
    (``short`` and ``long`` sides): ``X X^T`` and ``(.) X`` are ``short**2 * long`` each, the Gram matrix
    squared ``short**3``. Owners are balanced on it, not on elements: a 4096x64 matrix has a 512x512's
    elements and a twelfth of its work."""
    short, long = min(rows, cols), max(rows, cols)
    return short * short * (2 * long + short)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-shape learning rate, so rectangular matrices get updates of comparable RMS (per matrix of a batch)."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw": RMS like AdamW's


def momentum_buffer(state: dict[str, Any], shape: torch.Size, grad: torch.Tensor) -> torch.Tensor:
    """``state``'s momentum buffer of a ``shape`` matrix, made at the first step: zeros in ``grad``'s dtype, on its
    device."""
    buf = state.get(MOMENTUM)
    if buf is None:
        buf = state[MOMENTUM] = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    return buf


def muon_momentum(grad: torch.Tensor, state: dict[str, Any], momentum: float, nesterov: bool) -> torch.Tensor:
    """The matrix Muon orthogonalizes: the momentum buffer, or its Nesterov look-ahead; the gradient at momentum 0."""
    if momentum == 0:
        return grad
    buf = momentum_buffer(state, grad.shape, grad)
    out = torch.empty_like(grad) if nesterov else None
    muon_momentum_rows(grad, buf, out, momentum)
    return buf if out is None else out


def muon_momentum_rows(
    grad_rows: torch.Tensor, buf_rows: torch.Tensor | None, out_rows: torch.Tensor | None, momentum: float
) -> None:
    """``muon_momentum`` on one block of a matrix's rows, so an owner needs no whole gradient assembled first.

    ``buf_rows``: that block of the momentum buffer, updated in place (None at ``momentum=0``); ``out_rows``: that
    block of the matrix to orthogonalize (None where it is the buffer itself: plain momentum), written in its own
    dtype (bf16 for Newton-Schulz, which casts to it first anyway). Elementwise, so a matrix done block by block
    equals it done whole, bit for bit.
    """
    if buf_rows is not None:
        buf_rows.lerp_(grad_rows, 1 - momentum)
    if out_rows is None:
        return
    if buf_rows is None:
        out_rows.copy_(grad_rows)
    else:
        torch.lerp(grad_rows, buf_rows, momentum, out=out_rows)  # Nesterov's look-ahead


def check_hyperparameters(
    lr: float, weight_decay: float, momentum: float, coefficients: tuple, steps: int, adjust_lr_fn: str | None
) -> None:
    """Refuse at construction what ``torch.optim.Muon`` refuses, and a tensor lr, before any step runs."""
    if isinstance(lr, torch.Tensor):
        raise ValueError("OwnerComputedMuon takes a float lr (a tensor lr is not supported yet)")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {coefficients}")
    if not 0 < steps < 100:
        raise ValueError(f"ns_steps must be in 1..99, got {steps}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
