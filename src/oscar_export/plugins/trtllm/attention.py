"""The OSCAR attention backend for TensorRT-LLM's PyTorch models (NOT EXECUTED in TensorRT-LLM).

A subclass of TensorRT-LLM's ``AttentionBackend`` with upstream's constructor and both ``forward`` forms
(1.2: ``forward(q, k, v, metadata, *, attention_mask, **kwargs)``; main: ``forward(q, k, v, metadata,
forward_args=None, **kwargs)``, which ``Attention._attn_impl`` calls with ``forward_args=`` by keyword
(``_torch/modules/attention.py``); a preallocated ``forward_args.output`` / ``output=`` is written into). Its
``support_fused_rope`` / ``support_fused_qkv`` are classmethods answering False, as upstream's are
classmethods: the model's attention module, constructed for an unfused backend (``model.py``), hands it
post-RoPE ``q [tokens, H*D]``, ``k, v [tokens, H_kv*D]``; packed QKV (``k = v = None``) is refused.

Per forward (one layer), rows ``i < metadata.num_contexts`` are context requests (never "no cached tokens"),
handled together (``_context``; ``prefill.py``):

* the first chunks (``num_cached_tokens_per_seq[i] == 0``) attend at full precision (causal SDPA, TensorRT-LLM's
  scale ``1 / (q_scaling * sqrt(D))``), padded into one call per group of similar lengths
  (:func:`.prefill.packed_causal_attention`);
* a later chunk / prefix-reused context attends to the slot's committed cache through ``ops.chunk_attention``
  (the reference path has it; the AOT bundle has no chunk kernel yet, so on the GPU it raises and the
  deployment turns chunked prefill off);
* every stored row is then written at its cached length by one ``ops.write_planned`` (sink, INT2 pages through
  one quantize launch per pool, recent ring) as the forward's write plan says (``reference.plan_writes``, built
  once in ``begin_step`` for every layer); a row whose keys or values hold a NaN/Inf is flagged, so the step does
  not commit it and its request fails alone at the next ``prepare_resources`` (``cache.py``);

the generation rows take one device-only decode step over their own slots only (``ops.decode_step``: the
decode-step writer, ``decode_append``, which also rotates the step's queries into the stored key basis, once a
step; ``ops.decode``: split-K attention + merge over those queries and the step's lengths), reading their slots
from the cache manager's ``step_slots`` (written in ``prepare_resources``), so a CUDA graph of it replays with the
current batch's slots. The kernels index rows by batch position, so the scheduled slots' windows, lengths and
block-table rows are gathered into a batch of ``g`` rows (:func:`scheduled_rows`, copies; the pools are shared)
and the windows scattered back after the write: the cost is the batch's, not every slot's (a row -> slot index
inside the kernels would save the window copies). The first layer begins the page book's step, the last commits
it (``cache.py``). The output is in the stored value basis plus the value mean: the exported ``o_proj`` undoes
the value rotation.

``q_scaling`` is honoured by checking it against the softmax scale the bundle was compiled with (a
constexpr of the decode kernel): a mismatch is an error at model build time, never a silently wrong scale.
"""

from __future__ import annotations

import math
from dataclasses import replace

from oscar_export.kernels import reference

from .cache import STATUS_IDLE
from .prefill import packed_causal_attention
from .reference_ops import one_slot

#: INT2 pages per split program of the decode kernel (a deployment choice; any value > 0 is correct).
PAGES_PER_SPLIT = 8


#: a ``PagedKV``'s per-slot windows (written by the decode step) and lengths; the pools are shared by every slot
WINDOWS = ("sink_k", "sink_v", "recent_k", "recent_v")
LENGTHS = ("sink_len", "num_pages", "recent_len")


def scheduled_rows(state, rows):
    """``state`` restricted to the state rows ``rows [g]`` (device int64): the per-slot fields gathered (copies),
    the pools shared. The decode kernels index rows by batch position, so this is what they run over."""
    per_slot = WINDOWS + LENGTHS + ("block_table",)
    return replace(state, **{f: getattr(state, f).index_select(0, rows) for f in per_slot})


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def make_attention_class(up, deployment):
    """``OscarAttention(up.AttentionBackend)`` for one deployment."""
    import torch

    class OscarAttention(up.AttentionBackend):
        is_oscar_backend = True

        def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None, **kwargs):
            super().__init__(layer_idx, num_heads, head_dim, num_kv_heads, quant_config, **kwargs)
            q_scaling = float(kwargs.get("q_scaling") or 1.0)
            self.scale = 1.0 / (q_scaling * math.sqrt(head_dim))
            if not math.isclose(self.scale, deployment.sm_scale, rel_tol=1e-6):
                raise ValueError(f"layer {layer_idx}: q_scaling {q_scaling} gives softmax scale {self.scale}; the "
                                 f"kernel bundle was compiled for {deployment.sm_scale}: rebuild it for this model")
            lay = deployment.layout
            kv = self.num_kv_heads
            if (kv, head_dim) != (lay.num_kv_heads, lay.head_dim) or num_heads % kv:
                raise ValueError(f"layer {layer_idx}: {num_heads} heads / {kv} KV heads x {head_dim}; the OSCAR "
                                 f"layout has {lay.num_kv_heads} KV heads x {lay.head_dim}")
            if not 0 <= layer_idx < deployment.num_layers:
                raise ValueError(f"layer_idx {layer_idx}: the artifact has {deployment.num_layers} layers")

        @classmethod
        def support_fused_rope(cls) -> bool:
            return False

        @classmethod
        def support_fused_qkv(cls) -> bool:
            return False

        def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
            if k is None or v is None:
                raise RuntimeError(
                    f"OSCAR attention (layer {self.layer_idx}) got packed QKV (k, v None): the attention module was "
                    "wired for a fused backend, so RoPE was not applied either (see model.check_model)")
            mgr = metadata.kv_cache_manager
            if not getattr(mgr, "is_oscar_cache", False):
                raise RuntimeError(
                    f"OSCAR attention (layer {self.layer_idx}) got a {type(mgr).__name__} as the KV cache manager: "
                    "the OSCAR cache is not installed (the trtllm_module must be imported in the executor worker)"
                )
            chunked = getattr(getattr(metadata, "runtime_features", None), "chunked_prefill", False)
            if chunked and not getattr(mgr.ops[self.layer_idx], "chunked_prefill", False):
                raise NotImplementedError(
                    "enable_chunked_prefill: the OSCAR cache ops of this deployment have no kernel for a prompt chunk "
                    "after cached tokens; set it to false (deploy/extra_llm_api_options.yaml)")
            out = forward_args.output if forward_args is not None else kwargs.get("output")
            h, d = self.num_heads, self.head_dim
            if out is None:
                out = torch.empty(q.shape[0], h * d, dtype=q.dtype, device=q.device)
            i = self.layer_idx
            state, step_state, ops = mgr.layers[i], mgr.step_layers[i], mgr.ops[i]
            t = deployment.transform(self.layer_idx, q.device)
            nc, ns = int(metadata.num_contexts), int(getattr(metadata, "num_seqs", len(metadata.seq_lens)))
            seq_lens = [int(x) for x in metadata.seq_lens[:ns].tolist()]  # pinned host tensor: no device sync
            capturing = _capturing()
            if self.layer_idx == 0 and not capturing:
                mgr.streams.wait(mgr.admitted)  # admission's device writes land before this forward reads them
            if not capturing:
                self._check_step_slots(mgr, list(metadata.request_ids)[:ns])
            if self.layer_idx == 0:
                cached = metadata.kv_cache_params.num_cached_tokens_per_seq
                mgr.begin_step([(mgr.step_slots_host[i], int(cached[i]), seq_lens[i]) for i in range(nc)],
                               mgr.step_slots[nc:ns].long())
            offset = sum(seq_lens[:nc])
            if nc:
                self._context(mgr, state, ops, t, q[:offset], k[:offset], v[:offset], out[:offset])
            if ns > nc:
                g = ns - nc
                out[offset : offset + g] = self._decode(mgr, state, step_state, ops, t, q, k, v, offset, g, nc,
                                                        ns).to(out.dtype)
            if self.layer_idx == deployment.num_layers - 1:
                mgr.commit_step()
                if not capturing:
                    mgr.forward_done = mgr.streams.record()  # the next admission's writes wait for this forward
            return out

        def _context(self, mgr, state, ops, t, q, k, v, out) -> None:
            """The forward's context rows (packed, ``mgr.context_rows`` ``(slot, start, n)``): the first chunks
            attend at full precision in as few calls as their lengths allow (``prefill.py``), a later chunk to its
            slot's cache (``ops.chunk_attention``, one at a time: the reference path only); every stored row is then
            written with one planned write (``mgr.context_plan``, shared by the layers), and a row holding a NaN/Inf
            key or value is flagged so the step does not commit it (its request then fails alone, as in decode)."""
            h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            n = q.shape[0]
            qh, kh, vh, oh = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d), out.view(n, h, d)
            k_s = t.transform_keys(kh.transpose(0, 1)[None])[0].to(torch.bfloat16)  # [H_kv, n, D] stored basis
            v_s = t.transform_values(vh.transpose(0, 1)[None])[0].to(torch.bfloat16)
            first, offset = [], 0
            for slot, start, m in mgr.context_rows:
                if start == 0 or slot == mgr.scratch:  # a dummy request: computed, not stored
                    first.append((offset, m))
                else:
                    sl = slice(offset, offset + m)
                    o = ops.chunk_attention(one_slot(state, slot), qh[sl].transpose(0, 1), k_s[:, sl], v_s[:, sl], t)
                    oh[sl] = t.restore_output(o[None])[0].transpose(0, 1).to(out.dtype)
                offset += m
            packed_causal_attention(qh, kh, vh, first, self.scale, oh)
            ops.write_planned(state, mgr.context_plan, k_s, v_s, t)
            mgr.flag_context_rows(reference.nonfinite_rows(mgr.context_plan, k_s, v_s))

        def _decode(self, mgr, state, step_state, ops, t, q, k, v, offset, g, nc, ns):
            """One device-only decode step for the ``g`` generation rows (CUDA-graph capturable): the kernels run
            over those rows only (:func:`scheduled_rows`), not over every slot."""
            h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            rows = mgr.step_slots[nc:ns].long()  # [g] state rows; padding rows: the scratch slot
            sl = slice(offset, offset + g)
            ks = t.transform_keys(k[sl].view(g, hkv, 1, d)).squeeze(2).to(torch.bfloat16)  # [g, H_kv, D] stored
            vs = t.transform_values(v[sl].view(g, hkv, 1, d)).squeeze(2).to(torch.bfloat16)
            pad = rows == mgr.scratch  # computed, never stored
            # the book's flags (a slot that stopped at a NaN/Inf token) hold; padding rows write nothing
            status = torch.where(pad, STATUS_IDLE, mgr.book.status.index_select(0, rows)).to(torch.int32)
            sub = scheduled_rows(state, rows)
            q_s = ops.decode_step(sub, ks, vs, status, t, q[sl].view(g, h, d).to(torch.bfloat16))  # [g, H, D] fp32
            for name in WINDOWS:  # the step's token and demotions, back into the slots' windows
                getattr(state, name).index_copy_(0, rows, getattr(sub, name))
            flags = torch.zeros_like(mgr.book.status).index_copy_(0, rows, torch.where(pad, 0, status))
            mgr.book.flag(flags)  # a NaN/Inf token: the slot is not committed
            step_sub = replace(sub, **{f: getattr(step_state, f).index_select(0, rows) for f in LENGTHS})
            ob = ops.decode(q_s, step_sub, t, PAGES_PER_SPLIT)  # [g, H, D] stored value basis
            og = t.restore_output(ob[:, :, None].float()).squeeze(2)  # + v_mean
            return og.reshape(g, h * d)

        @staticmethod
        def _check_step_slots(mgr, request_ids) -> None:
            """Eager only: the batch rows must be the slots ``prepare_resources`` wrote (a request added to the
            batch after it, e.g. a padding request, is written here)."""
            want = mgr.slots_for(request_ids)
            if want != mgr.step_slots_host[: len(want)]:
                mgr._write_step_slots(want)

    OscarAttention.__qualname__ = OscarAttention.__name__
    return OscarAttention


__all__ = ["LENGTHS", "PAGES_PER_SPLIT", "WINDOWS", "make_attention_class", "scheduled_rows"]
