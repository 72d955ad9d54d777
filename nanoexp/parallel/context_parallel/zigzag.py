"""The zig-zag split of each sequence over the context-parallel ranks.

The sequence is cut into 2·cp chunks; cp rank r holds chunks r and 2·cp−1−r ("head-tail"), so a rank with an
early, cheap chunk of causal attention also holds a late, expensive one and every rank does the same work. The
trainer gives each cp rank its part of every micro-batch (`zigzag_split`), the model puts those tokens at their
positions (`zigzag_indices`), and the context-parallel attentions (ring.py, all_gather.py)
meet the other ranks' chunks.
"""
from __future__ import annotations

import torch


def rank_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2·cp sequence chunks that cp rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_start(local_len: int, cp: int, cp_rank: int, half: int) -> int:
    """The sequence index of the first token of half `half` (0 or 1) of what rank `cp_rank` holds; local_len =
    the 2 chunks a rank holds."""
    return rank_chunks(cp, cp_rank)[half] * (local_len // 2)


def zigzag_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions cp rank `cp_rank` holds, in its local order (ascending). seq_len must be a
    multiple of 2·cp (ValueError otherwise)."""
    if seq_len % (2 * cp):
        raise ValueError(f"the sequence length ({seq_len}) must be a multiple of 2·cp ({2 * cp})")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in rank_chunks(cp, cp_rank)])


def zigzag_split(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of x along the sequence dimension `dim` (1 for [b, s, ...], 2 for [b, heads, s, d])."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, cp_rank).to(x.device))


def document_starts(position_ids: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Under document masking: the sequence index where each local token's document starts, [b, s_local]
    (position_ids count from 0 in each document, and a document is contiguous in the sequence)."""
    local = zigzag_indices(position_ids.shape[1] * cp, cp, cp_rank).to(position_ids.device)
    return local - position_ids
