"""Device-side cache operations through the bundle's AOT kernels: what the TensorRT-LLM adapter launches.

Host-runtime agnostic (plain torch tensors + ``AotKernel`` driver-API launches on the current stream), so
the same code runs in the GPU tests without TensorRT-LLM (tests/gpu/test_trtllm_gpu.py compares it with the
Triton JIT; tests/gpu/test_aot_gpu.py with the reference). Every launch passes its arguments by parameter
name: their order, the warps and the grid are the launch plan's (``kernels/aot/launch_plan.py``; each
``AotKernel`` checks the binary against the manifest, whose specs the plan built).
:meth:`AotCacheOps.decode_step` and :meth:`AotCacheOps.decode` read
no device value on the host: the demotion is decided by the kernel from the device lengths, so a decode step
is capturable in a CUDA graph and cannot be one step late under TensorRT-LLM's overlap executor loop.
:class:`.reference_ops.TorchCacheOps` is the same interface on the PyTorch reference (the CPU contract tests).

Shapes (one layer, ``PagedKV`` of kernels/layout.py): windows BF16 ``[B, H_kv, S0 | W+P, D]``, pools
``[N, H_kv, P, D/4]`` uint8 + fp16 params, ``block_table [B, M]`` int32, lengths ``[B]`` int32.
"""

from __future__ import annotations

from oscar_export.kernels.aot.bundle import decode_plan, layout_tag
from oscar_export.kernels.aot.launcher import AotKernel
from oscar_export.kernels.transform import clip_rank


class AotCacheOps:
    """Demotion and decode attention of one layout with AOT kernels.

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
        self._step = None  # (demote_due, append): loaded on first use, so older bundles still serve the rest

    @property
    def demote_due(self):
        if self._step is None:
            self._step = (self._load("demote_due"), self._load("append"))
        return self._step[0]

    @property
    def append_one(self):
        self.demote_due  # noqa: B018 - loads both
        return self._step[1]

    # ---- demotion ------------------------------------------------------------------------------------------
    def _quantize(self, kernel, fmt, rows, page_ids, clip, levels, codes, params) -> None:
        """rows ``[N, H_kv, P, D]`` bf16 (last dim contiguous, any outer strides) -> pool pages ``page_ids``."""
        import torch

        group = self.layout.page_size if fmt.granularity == "channel" else fmt.group_size
        removals = (group - 1 - clip_rank(clip, group)).to(device=rows.device, dtype=torch.int32)  # [H_kv]
        if rows.stride(-1) != 1:
            raise ValueError(f"rows: the last dim must be contiguous, got strides {rows.stride()}")
        kernel.launch(named=dict(
            x_ptr=rows.data_ptr(), page_ids_ptr=page_ids, rank_ptr=removals, levels_ptr=levels, rot_ptr=levels,
            dscale_ptr=levels, mean_ptr=levels, codes_ptr=codes, params_ptr=params,  # rot/dscale/mean: unread
            stride_xn=rows.stride(0), stride_xh=rows.stride(1), stride_xp=rows.stride(2),
        ), grid_inputs={"N": rows.shape[0]})

    def demote(self, state, slot: int, page: int, pages_before: int, transform) -> None:
        """Quantize the oldest ``P`` recent tokens of ``slot`` into pool page ``page``; shift recent left.

        ``pages_before`` is the number of pages the sequence held (from the host-side book). Mirrors
        ``reference.demote`` (same bytes, same lengths).
        """
        import torch

        p = self.layout.page_size
        if pages_before >= state.block_table.shape[1]:
            raise ValueError(f"demote: slot {slot} already uses all {state.block_table.shape[1]} block-table columns")
        ids = torch.tensor([page], dtype=torch.int32, device=state.k_codes.device)
        for kernel, fmt, recent, clip, levels, codes, params in (
            (self.quant_k, self.layout.key, state.recent_k, transform.k_clip, transform.k_levels, state.k_codes,
             state.k_params),
            (self.quant_v, self.layout.value, state.recent_v, transform.v_clip, transform.v_levels, state.v_codes,
             state.v_params),
        ):
            self._quantize(kernel, fmt, recent[slot : slot + 1, :, :p], ids, clip, levels, codes, params)
            recent[slot, :, :-p] = recent[slot, :, p:].clone()
        state.block_table[slot, pages_before] = page
        state.num_pages[slot] += 1
        state.recent_len[slot] -= p

    # ---- the decode step (device-decided demotion + append, every row) ------------------------------------
    def decode_step(self, state, k, v, transform) -> None:
        """Append one token per row (``k, v [B, H_kv, D]`` bf16 stored basis), demoting first where the recent
        window is full, into the page ``block_table[b, num_pages[b]]`` names (the caller reserved it). Two
        launches, no host read: ``decode_step.decode_step_update`` through the bundle."""
        import torch

        lay = self.layout
        k_group = lay.page_size if lay.key.granularity == "channel" else lay.key.group_size
        rk = (k_group - 1 - clip_rank(transform.k_clip, k_group)).to(device=k.device, dtype=torch.int32)
        rv = (lay.value.group_size - 1 - clip_rank(transform.v_clip, lay.value.group_size)).to(
            device=k.device, dtype=torch.int32)
        b = k.shape[0]
        self.demote_due.launch(named=dict(
            recent_k_ptr=state.recent_k, recent_v_ptr=state.recent_v, k_codes_ptr=state.k_codes,
            k_params_ptr=state.k_params, v_codes_ptr=state.v_codes, v_params_ptr=state.v_params, k_rank_ptr=rk,
            v_rank_ptr=rv, k_levels_ptr=transform.k_levels, v_levels_ptr=transform.v_levels,
            block_table_ptr=state.block_table, num_pages_ptr=state.num_pages, recent_len_ptr=state.recent_len,
            max_pages=state.block_table.shape[1],
        ), grid_inputs={"B": b})
        self.append_one.launch(named=dict(
            k_ptr=k.contiguous(), v_ptr=v.contiguous(), sink_k_ptr=state.sink_k, sink_v_ptr=state.sink_v,
            recent_k_ptr=state.recent_k, recent_v_ptr=state.recent_v, sink_len_ptr=state.sink_len,
            num_pages_ptr=state.num_pages, recent_len_ptr=state.recent_len,
        ), grid_inputs={"B": b})

    def prefill_chunk(self, state, slot, q, k, v, page_ids, transform):
        raise NotImplementedError(
            "chunked prefill / prefix reuse (a context chunk with cached tokens) has no AOT kernel yet: serve with "
            "enable_chunked_prefill: false and kv_cache_config.enable_block_reuse: false "
            "(deploy/extra_llm_api_options.yaml)"
        )

    # ---- writing tokens ------------------------------------------------------------------------------------
    def prefill(self, state, slot: int, k, v, page_ids, transform) -> None:
        """Write a whole prompt of sequence ``slot`` (empty before): sink, INT2 pages, recent.

        Args:
            k, v: ``[H_kv, T, D]`` bf16 rows in the stored basis (``LayerTransform.transform_keys/values``
                rounded to bf16, as the reference rounds rows through the window dtype).
            page_ids: the ``layout.pages_for(T)`` pool pages the book allocated (``OscarCacheBook.grow``).
        Same bytes as ``reference.append_tokens`` of the whole prompt.
        """
        import torch

        t = k.shape[1]
        sink, pages, recent = self.layout.split(t)
        if len(page_ids) != pages:
            raise ValueError(f"prefill: a {t}-token prompt fills {pages} pages, got {len(page_ids)} page ids")
        p, hkv, d = self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim
        for rows, sink_buf, recent_buf in ((k, state.sink_k, state.recent_k), (v, state.sink_v, state.recent_v)):
            sink_buf[slot, :, :sink] = rows[:, :sink]
            recent_buf[slot, :, :recent] = rows[:, sink + pages * p :]
        if pages:
            ids = torch.tensor(list(page_ids), dtype=torch.int32, device=state.k_codes.device)
            for kernel, fmt, rows, clip, levels, codes, params in (
                (self.quant_k, self.layout.key, k, transform.k_clip, transform.k_levels, state.k_codes, state.k_params),
                (self.quant_v, self.layout.value, v, transform.v_clip, transform.v_levels, state.v_codes,
                 state.v_params),
            ):
                x = rows[:, sink : sink + pages * p].reshape(hkv, pages, p, d).transpose(0, 1)  # [N, H_kv, P, D] view
                self._quantize(kernel, fmt, x, ids, clip, levels, codes, params)
            state.block_table[slot, :pages] = ids
        state.sink_len[slot], state.num_pages[slot], state.recent_len[slot] = sink, pages, recent

    def append(self, state, slot: int, split_before: tuple[int, int, int], k, v) -> None:
        """Append one token (``k, v [H_kv, D]`` bf16, stored basis) to sequence ``slot``.

        ``split_before`` is ``(sink_len, num_pages, recent_len)`` before the token (the host-side book's
        ``split``); *recent* must have room (``OscarCacheBook.reserve_next`` demoted in the update step).
        """
        sink, pages, recent = split_before
        if sink < self.layout.sink and pages == 0 and recent == 0:
            state.sink_k[slot, :, sink], state.sink_v[slot, :, sink] = k, v
            state.sink_len[slot] = sink + 1
            return
        if recent >= self.layout.recent_capacity:
            raise ValueError(f"append: slot {slot} recent window is full ({recent}); demote first (reserve_next)")
        state.recent_k[slot, :, recent], state.recent_v[slot, :, recent] = k, v
        state.recent_len[slot] = recent + 1

    # ---- decode --------------------------------------------------------------------------------------------
    def decode(self, q, state, transform, pages_per_split: int, out=None):
        """One decode step: ``q [B, H, D]`` bf16 (model basis; the key rotation is fused) -> ``[B, H, D]`` bf16.

        Output is in the stored value basis (the exported ``o_proj`` undoes the value rotation).
        """
        import torch

        b = q.shape[0]
        plan = decode_plan(self.layout, b, self.num_heads, state.block_table.shape[1], pages_per_split)
        d = self.layout.head_dim
        part_o = torch.empty(b, self.num_heads, plan.n_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, self.num_heads, plan.n_splits, dtype=torch.float32, device=q.device)
        if out is None:
            out = torch.empty(b, self.num_heads, d, dtype=torch.bfloat16, device=q.device)
        a = plan.split_args()
        rot, dsc = transform.k_rotation.contiguous(), transform.k_scale.contiguous()  # the AOT ABI: dense
        self.split.launch(named=dict(
            q_ptr=q, rot_ptr=rot, dscale_ptr=dsc, sink_k_ptr=state.sink_k, sink_v_ptr=state.sink_v,
            recent_k_ptr=state.recent_k, recent_v_ptr=state.recent_v, k_codes_ptr=state.k_codes,
            k_params_ptr=state.k_params, v_codes_ptr=state.v_codes, v_params_ptr=state.v_params,
            k_levels_ptr=transform.k_levels, v_levels_ptr=transform.v_levels, block_table_ptr=state.block_table,
            sink_len_ptr=state.sink_len, num_pages_ptr=state.num_pages, recent_len_ptr=state.recent_len,
            part_o_ptr=part_o, part_lse_ptr=part_lse, **a,
        ), grid_inputs={"B": b})
        self.merge.launch(named=dict(part_o_ptr=part_o, part_lse_ptr=part_lse, out_ptr=out, n_splits=plan.n_splits),
                          grid_inputs={"rows": b * self.num_heads})
        return out


__all__ = ["AotCacheOps"]
