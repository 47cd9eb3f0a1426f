"""The TensorRT-LLM adapter's cache operations on the PyTorch reference (``kernels/reference.py``), any device.

Same interface and same semantics as :class:`.device.AotCacheOps` (the bundle's kernels), so the adapter's
contract tests run on a CPU: ``decode_step`` treats every row exactly as ``_demote_due_kernel`` +
``_append_kernel`` do (demote where ``recent_len == W + P`` into ``block_table[b, num_pages[b]]``, then append),
``decode`` is ``reference.decode_attention`` with the query rotated as the fused kernel does.
Host reads (``int(...)``) are allowed here: this path is the oracle, not the one captured in CUDA graphs.
"""

from __future__ import annotations


from oscar_export.kernels import reference


class TorchCacheOps:
    """Reference cache operations of one layout (see the module doc)."""

    def __init__(self, layout, num_heads: int, sm_scale: float) -> None:
        self.layout, self.num_heads, self.sm_scale = layout, num_heads, sm_scale

    def prefill(self, state, slot: int, k, v, page_ids, transform) -> None:
        """Write a whole prompt ``k, v [H_kv, T, D]`` (stored basis) into the empty sequence ``slot``."""
        t = k.shape[1]
        if len(page_ids) != self.layout.pages_for(t):
            raise ValueError(f"prefill: a {t}-token prompt fills {self.layout.pages_for(t)} pages, got {len(page_ids)}")
        ids = iter(page_ids)
        reference.append_tokens(state, slot, k, v, self.layout, transform, lambda: next(ids))

    def prefill_chunk(self, state, slot: int, q, k, v, page_ids, transform):
        """A later prompt chunk: ``q [H, n, D]`` (model basis), ``k, v [H_kv, n, D]`` stored basis. Attends to the
        cache as stored and causally to itself, then is written. Returns ``[H, n, D]`` in the stored value basis."""
        qs = transform.transform_queries(q[None])
        out = reference.chunk_attention(qs, k[None], v[None], _row(state, slot), self.layout, transform.k_levels,
                                        transform.v_levels, self.sm_scale)[0]
        have = int(state.num_pages[slot])
        ids = iter(page_ids[have:])
        reference.append_tokens(state, slot, k, v, self.layout, transform, lambda: next(ids))
        return out

    def decode_step(self, state, k, v, transform) -> None:
        """``k, v [B, H_kv, D]`` stored basis: per row, demote where the window is full, then append."""
        for b in range(k.shape[0]):
            if int(state.recent_len[b]) == self.layout.recent_capacity:
                page = int(state.block_table[b, int(state.num_pages[b])])
                reference.demote(state, b, page, self.layout, transform)
            reference.append_tokens(state, b, k[b, :, None], v[b, :, None], self.layout, transform, _no_page)

    def decode(self, q, state, transform, pages_per_split: int = 8):
        """``q [B, H, D]`` model basis -> ``[B, H, D]`` stored value basis (float32)."""
        qs = transform.transform_queries(q[:, :, None].float()).squeeze(2)
        return reference.decode_attention(qs, state, self.layout, transform.k_levels, transform.v_levels, self.sm_scale)


def _row(state, b: int):
    """Sequence ``b`` of ``state`` as a batch of one (views)."""
    from dataclasses import fields

    return type(state)(**{f.name: getattr(state, f.name)[b : b + 1] if f.name not in (
        "k_codes", "k_params", "v_codes", "v_params") else getattr(state, f.name) for f in fields(state)})


def _no_page() -> int:
    raise AssertionError("decode_step: a demotion page must come from the block table, not an allocator")


__all__ = ["TorchCacheOps"]
