"""The decode kernels with TensorRT's AOT-plugin calling convention: tensor inputs, int32 extras, outputs.

TensorRT's ``@trtp.aot_impl`` launches one kernel whose parameters are the plugin's input tensors, then the
int32 "extra args", then its output tensors. The decode kernels (``kernels/decode/portable.py``,
``kernels/decode/splits.py``) put their outputs before their integer arguments, so these two thin kernels take the
TensorRT order and call the originals (Triton inlines them): no math of their own, same binary arithmetic. Their
parameter lists are ``launch_plan.TRT_DECODE_SPLIT`` / ``TRT_DECODE_MERGE`` (checked against ``arg_names`` in
tests/kernels/test_aot_launch_plan.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..decode.portable import decode_split_kernel
from ..decode.splits import merge_kernel


@triton.jit
def _decode_split_trt_kernel(
    q_ptr,
    sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
    k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
    block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr,
    max_pages, pages_per_split, n_page_splits, n_splits,
    part_o_ptr, part_lse_ptr,
    H_KV: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    P: tl.constexpr, S0: tl.constexpr, RC: tl.constexpr, BN: tl.constexpr, SM_SCALE: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr,
    FAST_UNPACK: tl.constexpr, NB: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """``decode_split_kernel`` with the outputs (part_o, part_lse) last. Grid ``(B * H_kv, n_splits)``."""
    decode_split_kernel(
        q_ptr, sink_k_ptr, sink_v_ptr, recent_k_ptr, recent_v_ptr,
        k_codes_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, k_levels_ptr, v_levels_ptr,
        block_table_ptr, sink_len_ptr, num_pages_ptr, recent_len_ptr, part_o_ptr, part_lse_ptr,
        max_pages, pages_per_split, n_page_splits, n_splits,
        H_KV, GQ, GQ_PAD, D, G, P, S0, RC, BN, SM_SCALE, K_CHANNEL, K_CODEBOOK, V_CODEBOOK, FAST_UNPACK, NB,
        KEY_BITS,
    )


@triton.jit
def _merge_trt_kernel(part_o_ptr, part_lse_ptr, n_splits, out_ptr, D: tl.constexpr, CH: tl.constexpr):
    """``merge_kernel`` with the output last. Grid ``(B * H,)``."""
    merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, n_splits, D, CH)
