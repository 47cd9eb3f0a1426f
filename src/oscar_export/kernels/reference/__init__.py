"""What the bytes mean: the readable PyTorch definition of every cache op.

This is the test oracle for the Triton kernels and the ``torch.compile`` path of the Hugging Face
integration. The pure functions (pack, quantize, dequantize, attention) are static-shape and free of
``.item()`` and value-dependent branching, so they compile with ``torch.compile(fullgraph=True)``. The
decode step's writer (``decode_append``) is device-only too; prompts and chunks are planned on the host
(``plan_writes``) and written without host reads. Callers write
``from oscar_export.kernels import reference`` and ``reference.<op>``.

Where each op lives (each module imports only those above it):

=================  ================================================================================================
``packing``        codes <-> bytes: ``pack_codes`` (linear), ``pack_mma16`` (MMA fragment order), whole pages in a
                   row format's packing (``pack_page_codes``); each with its ``unpack_*``
``groups``         the quantizer's rounding rule on one group: ``quantize_groups``, ``dequantize_groups``,
                   ``clip_threshold``, ``span_inverse``
``page_quant``     whole pages of a row format: ``quantize_pages``, ``dequantize_pages``, ``format_levels``
``context``        the cache read back dense: ``gather_context`` (+ its eager memo form ``gather_context_memo``),
                   ``context_mask``, ``recent_valid``; one sequence in token order: ``read_sequence``
``attention``      ``masked_attention``, ``decode_attention``, ``chunk_attention``
``writers``        prompts and chunks into the cache: a packed batch as its ``WritePlan`` says (``plan_writes``,
                   ``write_planned``, ``nonfinite_rows``), one sequence (``write_tokens``), ``write_pages``,
                   ``append_tokens``, ``check_finite``
``decode_step``    the decode step's one-token write: ``decode_append`` (device-only) and
                   ``decode_append_host`` (eager host code, the same bytes)
=================  ================================================================================================
"""

from .attention import chunk_attention, decode_attention, masked_attention
from .context import context_mask, gather_context, gather_context_memo, read_sequence, recent_valid
from .decode_step import decode_append, decode_append_host
from .groups import clip_threshold, dequantize_groups, quantize_groups, span_inverse
from .packing import (
    mma16_group,
    pack_codes,
    pack_mma16,
    pack_page_codes,
    unpack_codes,
    unpack_mma16,
    unpack_page_codes,
)
from .page_quant import dequantize_pages, format_levels, quantize_pages
from .writers import (
    WritePlan,
    append_tokens,
    check_finite,
    nonfinite_rows,
    plan_writes,
    write_pages,
    write_planned,
    write_tokens,
)

__all__ = [
    "WritePlan",
    "append_tokens",
    "check_finite",
    "chunk_attention",
    "clip_threshold",
    "context_mask",
    "decode_append",
    "decode_append_host",
    "decode_attention",
    "dequantize_groups",
    "dequantize_pages",
    "format_levels",
    "gather_context",
    "gather_context_memo",
    "masked_attention",
    "mma16_group",
    "nonfinite_rows",
    "pack_codes",
    "pack_mma16",
    "pack_page_codes",
    "plan_writes",
    "quantize_groups",
    "quantize_pages",
    "read_sequence",
    "recent_valid",
    "span_inverse",
    "unpack_codes",
    "unpack_mma16",
    "unpack_page_codes",
    "write_pages",
    "write_planned",
    "write_tokens",
]
