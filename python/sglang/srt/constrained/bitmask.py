"""Packed token bitmasks: allocation, unpacking and application to logits (CPU and CUDA).

Layout (xgrammar's): ``[bs, ceil(vocab_size / 32)]`` int32; bit ``j`` (LSB = 0) of word ``i``
set means token ``32 * i + j`` is allowed. A row of all ``-1`` words allows every token.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per row for ``vocab_size`` tokens."""
    return (vocab_size + BITS - 1) // BITS


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU [batch_size, ceil(vocab_size / 32)] int32 bitmask with every token allowed (all bits set).

    Raises:
        ValueError: batch_size < 0 or vocab_size < 1.
    """
    if batch_size < 0 or vocab_size < 1:
        raise ValueError(f"need batch_size >= 0 and vocab_size >= 1, got {batch_size}, {vocab_size}")
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[bs, vocab_size] bool (True = allowed) from a packed [bs, W] int32 bitmask, on its device.

    Raises:
        ValueError: the bitmask is not 2-D int32 with ``W >= ceil(vocab_size / 32)``.
    """
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] < bitmask_width(vocab_size):
        raise ValueError(f"bitmask must be [bs, >= {bitmask_width(vocab_size)}] int32, "
                         f"got {tuple(bitmask.shape)} {bitmask.dtype}")
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to ``-inf`` in place; rows that allow every token are unchanged.

    On CUDA xgrammar's fused kernel is used when importable, else (and on CPU) a torch
    implementation (unpack + ``masked_fill_``). Logit columns beyond the bitmask's coverage are
    not possible (the bitmask must cover ``logits.shape[1]``).

    Args:
        logits: [bs, vocab] float32 (any float dtype) on CPU or CUDA.
        bitmask: [bs, >= ceil(vocab / 32)] int32 on the same device.
    Raises:
        ValueError: the shapes or devices disagree.
    """
    bs, vocab = logits.shape
    if bitmask.shape[0] != bs or bitmask.device != logits.device:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} on {bitmask.device} does not match logits "
                         f"{tuple(logits.shape)} on {logits.device}; move it with bitmask.to(logits.device)")
    if logits.is_cuda:
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
            return
        except Exception as e:  # noqa: BLE001 - fall back to torch (e.g. no compiled kernel)
            logger.debug("xgrammar bitmask kernel unavailable (%s); using torch", e)
    logits.masked_fill_(~unpack_token_bitmask(bitmask, vocab), float("-inf"))


def revive_dead_rows_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Rows whose logits are all ``-inf`` after masking get logit 0 on their allowed tokens.

    This happens when a penalty (e.g. ``min_new_tokens`` banning EOS) removed every token the
    grammar allows; the grammar wins (the output must stay valid), so the row samples uniformly
    among the allowed tokens. A row whose bitmask allows nothing gets 0 everywhere (the sampled
    token is then rejected by the grammar and the request aborted). No host synchronization.

    Args:
        logits: [bs, vocab] float on CPU or CUDA, modified in place.
        bitmask: [bs, W] int32 on the same device.
    """
    vocab = logits.shape[1]
    allowed = unpack_token_bitmask(bitmask, vocab)
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    logits.masked_fill_(dead & allowed, 0.0)
