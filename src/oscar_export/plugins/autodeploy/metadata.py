"""The OSCAR cache's lengths and block table, derived from AutoDeploy's sequence metadata (no book of our own).

AutoDeploy's ``SequenceInfo`` (``custom_ops/attention_interface.py`` @086f0cea) gives, per batch row ``i``,
``input_pos[i]`` (tokens already cached), ``seq_len[i]`` (tokens of this forward), ``slot_idx[i]`` and the row's
pages ``cache_loc[cu_num_pages[i] : cu_num_pages[i + 1]]``; ``batch_info_host`` the rows of each kind, prefill
rows first (:func:`batch_counts`); ``max_seq_info_host[1]`` is ``max_blocks_per_seq``,
constant once the cache exists (``update_cache_information``). So:

* committed lengths = ``layout.split(input_pos)`` (what the writes start from), the step's =
  ``layout.split(input_pos + seq_len)`` (what the decode attention reads): :func:`prepare_metadata`, run once a
  forward (the ``prepare_metadata`` op of ``get_prepare_extra_metadata_info``);
* the block table row ``i`` = the row's AutoDeploy blocks, ``max_blocks_per_seq`` wide (:func:`block_table`). A
  sequence of ``T`` tokens holds ``ceil(T / P)`` blocks, at least the ``layout.pages_for(T)`` INT2 pages it uses;
  the rest of its blocks stay unused (the BF16 windows are per slot).

The one state AutoDeploy's metadata does not carry: a token that is not committed (NaN/Inf), since the runtime
advances ``input_pos`` regardless; that is the ``nonfinite`` slot flag (``resources.py``, ``cached_attention.py``).
"""

from __future__ import annotations

import torch

from oscar_export.kernels.layout import split_length


@torch.library.custom_op("oscar_ad::prepare_metadata", mutates_args=())
def prepare_metadata(input_pos: torch.Tensor, seq_len: torch.Tensor, sink: int, recent_capacity: int,
                     page_size: int) -> list[torch.Tensor]:
    """``input_pos, seq_len [max_batch]`` int32 -> ``[sink_len, num_pages, recent_len]`` of the committed
    lengths, then of the step's (six ``[max_batch]`` int32; rows past the batch are garbage in, garbage out)."""
    before = split_length(input_pos.long(), sink, recent_capacity, page_size)
    after = split_length(input_pos.long() + seq_len.long(), sink, recent_capacity, page_size)
    return [x.to(torch.int32) for x in (*before, *after)]


@prepare_metadata.register_fake
def _prepare_metadata_fake(input_pos, seq_len, sink, recent_capacity, page_size):
    return [torch.empty_like(input_pos, dtype=torch.int32) for _ in range(6)]


#: how many tensors :func:`prepare_metadata` returns (``get_prepare_extra_metadata_info``'s ``num_meta_out``)
NUM_METADATA = 6


def batch_counts(batch_info_host: torch.Tensor) -> tuple[int, int, int]:
    """``(context rows, their tokens, decode rows)`` of ``batch_info_host`` (host): @086f0cea's three slots
    ``[num_prefill, num_prefill_tokens, num_decode]``, or the twelve of the ``BatchInfo`` of a later copy of the same
    file (the index names no commit for it): ``[num_prefill, num_prefill_tokens, num_extend, num_extend_tokens,
    num_decode, ...]``, extend rows (after prefill, before decode) counted as context rows, as its
    ``get_absorbed_info`` does."""
    info = [int(x) for x in batch_info_host.tolist()]
    if len(info) == 3:
        return info[0], info[1], info[2]
    if len(info) == 12:
        return info[0] + info[2], info[1] + info[3], info[4]
    raise ValueError(f"batch_info_host: expected 3 or 12 entries, got {len(info)}")


def block_table(cache_loc: torch.Tensor, cu_num_pages: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` int32: row ``i`` holds ``cache_loc[cu_num_pages[i] : cu_num_pages[i + 1]]``, zeros after
    (device ops only; entries past a row's pages are never read: ``PagedKV.block_table``)."""
    start = cu_num_pages[:rows].long()
    count = cu_num_pages[1 : rows + 1].long() - start
    col = torch.arange(width, device=cache_loc.device)
    idx = (start[:, None] + col[None]).clamp(max=max(cache_loc.numel() - 1, 0))
    return torch.where(col[None] < count[:, None], cache_loc[idx], 0).to(torch.int32)


__all__ = ["NUM_METADATA", "batch_counts", "block_table", "prepare_metadata"]
