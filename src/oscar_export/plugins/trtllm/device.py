"""Device-side cache operations through the bundle's AOT kernels: what the TensorRT-LLM adapter launches.

Host-runtime agnostic (plain torch tensors + ``AotKernel`` driver-API launches on the current stream), so
the same code runs in the GPU tests without TensorRT-LLM (tests/gpu/test_trtllm_gpu.py compares it with the
Triton JIT; tests/gpu/test_aot_gpu.py with the reference). Every launch passes its arguments by parameter
name: their order, the warps and the grid are the launch plan's (``kernels/aot/launch_plan.py``; each
``AotKernel`` checks the binary against the manifest, whose specs the plan built).
:meth:`AotCacheOps.decode_step` (one ``decode_append`` launch, which also rotates the step's queries into the stored
key basis: once a step, docs/design.md §3.6) and :meth:`AotCacheOps.decode` (over those queries) read
no device value on the host: the demotion is decided by the kernel from the committed lengths, so a decode step
is capturable in a CUDA graph and cannot be one step late under TensorRT-LLM's overlap executor loop.
:class:`.reference_ops.TorchCacheOps` is the same interface on the PyTorch reference (the CPU contract tests).

Shapes (one layer, ``PagedKV`` of kernels/layout.py): sink BF16 ``[B, H_kv, S0, D]``, recent ring BF16
``[B, H_kv, C = W + 2P, D]``, pools
``[N, H_kv, P, D/4]`` uint8 + fp16 params, ``block_table [B, M]`` int32, lengths ``[B]`` int32.
"""

from __future__ import annotations

from oscar_export.kernels import reference
from oscar_export.kernels.aot.bundle import decode_plan, layout_tag
from oscar_export.kernels.aot.launcher import AotKernel
from oscar_export.kernels.transform import clip_rank


class AotCacheOps:
    """Token writes, the decode step and decode attention of one layout with AOT kernels.

    Args:
        manifest: a verified bundle manifest (``read_manifest``).
        layout: the artifact's layout; num_heads: H.
        source: ``"cubin"`` or ``"ptx"``.
    """

    def __init__(self, manifest, layout, num_heads: int, source: str = "cubin") -> None:
        self.layout, self.num_heads = layout, num_heads
        tag = layout_tag(layout, num_heads)
        self._load = lambda name: AotKernel(manifest, f"{name}_{tag}", source=source)  # noqa: E731
        self.quant_k, self.quant_v = self._load("quant_pack_k"), self._load("quant_pack_v")
        self.split, self.merge = self._load("decode_split"), self._load("decode_merge")
        check_query_rotation(self.split.entry.spec)
        self._append = None  # decode_append: loaded on first use, so older bundles still serve the rest

    @property
    def append_kernel(self):
        if self._append is None:
            kernel = self._load("decode_append")
            check_query_rotation(kernel.entry.spec)
            self._append = kernel
        return self._append

    def _removals(self, fmt, clip, device):
        """int32 ``[H_kv]`` values each quantization group drops before its max (``decode_step.removals``)."""
        import torch

        group = self.layout.page_size if fmt.granularity == "channel" else fmt.group_size
        return (group - 1 - clip_rank(clip, group)).to(device=device, dtype=torch.int32)

    # ---- pages ---------------------------------------------------------------------------------------------
    def _quantize(self, kernel, fmt, rows, page_ids, clip, levels, codes, params) -> None:
        """rows ``[N, H_kv, P, D]`` bf16 (last dim contiguous, any outer strides) -> pool pages ``page_ids``."""
        if rows.stride(-1) != 1:
            raise ValueError(f"rows: the last dim must be contiguous, got strides {rows.stride()}")
        kernel.launch(named=dict(
            x_ptr=rows.data_ptr(), page_ids_ptr=page_ids, rank_ptr=self._removals(fmt, clip, rows.device),
            levels_ptr=levels, rot_ptr=levels, dscale_ptr=levels, mean_ptr=levels,  # rot/dscale/mean: unread
            codes_ptr=codes, params_ptr=params,
            stride_xn=rows.stride(0), stride_xh=rows.stride(1), stride_xp=rows.stride(2),
        ), grid_inputs={"N": rows.shape[0]})

    def write_pages(self, state, page_ids, k, v, layout, transform) -> None:
        """``reference.write_pages`` with the quantize kernels: ``k, v [N, H_kv, P, D]`` bf16 stored basis."""
        import torch

        ids = torch.as_tensor(page_ids, device=state.k_codes.device).int()  # a list or a device tensor
        for kernel, fmt, rows, clip, levels, codes, params in (
            (self.quant_k, layout.key, k, transform.k_clip, transform.k_levels, state.k_codes, state.k_params),
            (self.quant_v, layout.value, v, transform.v_clip, transform.v_levels, state.v_codes, state.v_params),
        ):
            self._quantize(kernel, fmt, rows, ids, clip, levels, codes, params)

    # ---- writing tokens ------------------------------------------------------------------------------------
    def write(self, state, slot: int, start: int, k, v, transform) -> None:
        """Write ``k, v [H_kv, T, D]`` bf16 rows in the stored basis at positions ``start ..`` of sequence
        ``slot``: ``reference.write_tokens`` (sink, recent ring: tensor copies) with its pages quantized by the
        bundle's kernels (same bytes). Lengths are the page book's to commit."""
        reference.write_tokens(state, slot, start, k, v, self.layout, transform, write=self.write_pages)

    def write_planned(self, state, plan, k, v, transform) -> None:
        """``reference.write_planned`` with the pages quantized by the bundle's kernels (one launch per pool for the
        whole batch): ``k, v [H_kv, sum T, D]`` bf16 stored basis, as ``plan`` (``reference.plan_writes``) says."""
        reference.write_planned(state, plan, k, v, self.layout, transform, write=self.write_pages)

    #: a context chunk after cached tokens (chunked prefill) has a kernel here (``attention.py`` refuses it at the
    #: first forward where upstream's ``runtime_features.chunked_prefill`` is on and this is False)
    chunked_prefill = False

    def chunk_attention(self, state, q, k, v, transform):
        raise NotImplementedError(
            "chunked prefill / prefix reuse (a context chunk with cached tokens) has no AOT kernel yet: serve with "
            "enable_chunked_prefill: false and kv_cache_config.enable_block_reuse: false "
            "(deploy/extra_llm_api_options.yaml)"
        )

    # ---- the decode step (device-decided demotion + token, every row) -------------------------------------
    def decode_step(self, state, k, v, status, transform, q):
        """Append one token per row (``k, v [B, H_kv, D]`` bf16 stored basis) to ``state`` (committed lengths),
        demoting where the recent ring holds ``W + P`` tokens into the page ``block_table[b, num_pages[b]]``
        names; a row whose ``status [B]`` int32 is nonzero writes nothing (NaN/Inf rows set
        ``STATUS_NONFINITE``). One launch, no host read: ``decode_step.decode_append`` through the bundle
        (``TRANSFORM`` off: the keys are already in the stored basis; ``ROTATE_Q`` on).

        Args:
            q: ``[B, H, D]`` bf16 the step's queries in the model basis (post-RoPE), every row.
        Returns:
            ``[B, H, D]`` fp32 the queries in the stored key basis, ``(q @ R_K) / d_K`` per KV head (every row,
            whatever its status): what :meth:`decode` takes.
        """
        import torch

        lay, tr = self.layout, transform
        q = q.contiguous()
        q_s = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        self.append_kernel.launch(named=dict(
            k_ptr=k.contiguous(), v_ptr=v.contiguous(), q_ptr=q, q_rot_ptr=q_s,
            rot_ptr=tr.k_rotation.contiguous(),  # the AOT ABI: dense
            kscale_ptr=tr.k_scale.contiguous(), kmean_ptr=tr.k_mean.contiguous(),
            vmean_ptr=tr.v_mean.contiguous(),  # read only with TRANSFORM
            sink_k_ptr=state.sink_k, sink_v_ptr=state.sink_v, recent_k_ptr=state.recent_k,
            recent_v_ptr=state.recent_v, k_codes_ptr=state.k_codes, k_params_ptr=state.k_params,
            v_codes_ptr=state.v_codes, v_params_ptr=state.v_params,
            k_rank_ptr=self._removals(lay.key, transform.k_clip, k.device),
            v_rank_ptr=self._removals(lay.value, transform.v_clip, k.device),
            k_levels_ptr=transform.k_levels, v_levels_ptr=transform.v_levels, block_table_ptr=state.block_table,
            sink_len_ptr=state.sink_len, num_pages_ptr=state.num_pages, recent_len_ptr=state.recent_len,
            status_ptr=status, max_pages=state.block_table.shape[1],
        ), grid_inputs={"B": k.shape[0]})
        return q_s

    # ---- decode --------------------------------------------------------------------------------------------
    def decode(self, q_s, state, transform, pages_per_split: int, out=None):
        """One decode step: ``q_s [B, H, D]`` fp32 in the stored key basis (what :meth:`decode_step` returned) ->
        ``[B, H, D]`` bf16.

        Output is in the stored value basis (the exported ``o_proj`` undoes the value rotation).
        """
        import torch

        b = q_s.shape[0]
        plan = decode_plan(self.layout, b, self.num_heads, state.block_table.shape[1], pages_per_split)
        d = self.layout.head_dim
        part_o = torch.empty(b, self.num_heads, plan.n_splits, d, dtype=torch.float32, device=q_s.device)
        part_lse = torch.empty(b, self.num_heads, plan.n_splits, dtype=torch.float32, device=q_s.device)
        if out is None:
            out = torch.empty(b, self.num_heads, d, dtype=torch.bfloat16, device=q_s.device)
        a = plan.split_args()
        self.split.launch(named=dict(
            q_ptr=q_s, sink_k_ptr=state.sink_k, sink_v_ptr=state.sink_v,
            recent_k_ptr=state.recent_k, recent_v_ptr=state.recent_v, k_codes_ptr=state.k_codes,
            k_params_ptr=state.k_params, v_codes_ptr=state.v_codes, v_params_ptr=state.v_params,
            k_levels_ptr=transform.k_levels, v_levels_ptr=transform.v_levels, block_table_ptr=state.block_table,
            sink_len_ptr=state.sink_len, num_pages_ptr=state.num_pages, recent_len_ptr=state.recent_len,
            part_o_ptr=part_o, part_lse_ptr=part_lse, **a,
        ), grid_inputs={"B": b})
        self.merge.launch(named=dict(part_o_ptr=part_o, part_lse_ptr=part_lse, out_ptr=out, n_splits=plan.n_splits),
                          grid_inputs={"rows": b * self.num_heads})
        return out


def check_query_rotation(spec) -> None:
    """Raise ``BundleError`` unless ``spec`` (a bundle's ``decode_append`` or split kernel) gives the queries the way
    this adapter does: the append launch rotates them (``ROTATE_Q``), the split kernel reads fp32 stored-basis
    queries. A bundle built before the rotation moved into the append launch has neither."""
    from oscar_export.kernels.aot.manifest import BundleError

    cx, types = spec.constexpr_dict, {p.name: p.type for p in spec.params}
    if "q_rot_ptr" in types:
        ok, want = cx.get("ROTATE_Q") is True, "the step's query rotation (ROTATE_Q)"
    else:
        ok, want = types.get("q_ptr") == "*fp32" and not cx.get("ROTATE_Q", False), "fp32 stored-basis queries"
    if not ok:
        raise BundleError(f"{spec.name}: built without {want}; rebuild the bundle with this version "
                          "(oscar-export build)")


__all__ = ["AotCacheOps", "check_query_rotation"]
