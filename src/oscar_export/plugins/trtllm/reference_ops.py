"""The TensorRT-LLM adapter's cache operations on the PyTorch reference (``kernels/reference/``), any device.

Same interface and same semantics as :class:`.device.AotCacheOps` (the bundle's kernels), so the adapter's
contract tests run on a CPU: ``write`` is ``reference.write_tokens``, ``decode_step`` is
``reference.decode_append`` (what ``_decode_append_kernel`` does: the token into the sink or the recent ring,
a demotion where ``recent_len == W + P`` into ``block_table[b, num_pages[b]]``, nothing for a flagged row) and
returns the step's queries in the stored key basis (``transform_queries``, as the append launch does), ``decode``
is ``reference.decode_attention`` over them.
Host reads (``int(...)``) are allowed here: this path is the oracle, not the one captured in CUDA graphs.
"""

from __future__ import annotations

from oscar_export.kernels import reference


class TorchCacheOps:
    """Reference cache operations of one layout (see the module doc)."""

    #: a context chunk after cached tokens has a path here (``reference.chunk_attention``)
    chunked_prefill = True

    def __init__(self, layout, num_heads: int, sm_scale: float) -> None:
        self.layout, self.num_heads, self.sm_scale = layout, num_heads, sm_scale

    def write(self, state, slot: int, start: int, k, v, transform) -> None:
        """Write ``k, v [H_kv, T, D]`` (stored basis) at positions ``start ..`` of sequence ``slot`` (a prompt or a
        chunk; the pages are the ones its block-table row names). Lengths are the page book's to commit."""
        reference.write_tokens(state, slot, start, k, v, self.layout, transform)

    def write_planned(self, state, plan, k, v, transform) -> None:
        """Write the packed ``k, v [H_kv, sum T, D]`` (stored basis) of a batch of sequences as ``plan``
        (``reference.plan_writes``) says."""
        reference.write_planned(state, plan, k, v, self.layout, transform)

    def chunk_attention(self, state, q, k, v, transform):
        """A later prompt chunk of a batch-of-one ``state`` (committed lengths): ``q [H, n, D]`` (model basis),
        ``k, v [H_kv, n, D]`` stored basis. Returns ``[H, n, D]`` in the stored value basis."""
        qs = transform.transform_queries(q[None])
        return reference.chunk_attention(qs, k[None], v[None], state, self.layout, transform.k_levels,
                                         transform.v_levels, self.sm_scale)[0]

    def decode_step(self, state, k, v, status, transform, q):
        """``k, v [B, H_kv, D]`` stored basis, ``status [B]`` int32 (rows with a bit set write nothing; NaN/Inf
        rows get ``STATUS_NONFINITE``), ``state`` with the committed lengths; ``q [B, H, D]`` the step's queries
        (model basis). Returns ``[B, H, D]`` float32 ``q`` in the stored key basis, every row.

        One row at a time (views of ``state``): ``reference.decode_append`` stores every row's candidate page
        with one indexed assignment, and here rows may name the same pool page (unassigned block-table
        entries are 0), where an indexed assignment with repeated indices keeps an arbitrary one."""
        for b in range(k.shape[0]):
            reference.decode_append(one_slot(state, b), k[b : b + 1], v[b : b + 1], status[b : b + 1], self.layout,
                                    transform)
        return transform.transform_queries(q[:, :, None].float()).squeeze(2)

    def decode(self, q_s, state, transform, pages_per_split: int = 8):
        """``q_s [B, H, D]`` stored key basis (:meth:`decode_step`'s) -> ``[B, H, D]`` stored value basis (float32)."""
        return reference.decode_attention(q_s, state, self.layout, transform.k_levels, transform.v_levels,
                                          self.sm_scale)


def one_slot(state, slot: int):
    """Slot ``slot`` of ``state`` as a batch of one (views; the pools are shared)."""
    from dataclasses import fields

    pools = ("k_codes", "k_params", "v_codes", "v_params")
    return type(state)(**{f.name: getattr(state, f.name) if f.name in pools else getattr(state, f.name)[slot : slot + 1]
                          for f in fields(state)})


__all__ = ["TorchCacheOps", "one_slot"]
