"""The OSCAR cached-attention op that AutoDeploy puts in place of each source attention node.

Its signature follows the order ``transform/library/kvcache.py`` (``_insert_cached_attn_node``) gives a cached op's
arguments -- ``(*qkv, *standard metadata, *extra metadata, *caches, *constants)`` -- with the standard metadata the
descriptor asks for by name, the extra metadata :func:`.metadata.prepare_metadata`'s six lengths, the caches
``resources.CACHE_NAMES`` and the constants ``(binding, layer, scale)`` (``binding.py``). Per layer and forward,
with the context rows first (``metadata.batch_counts``: prefill, and extend rows where the interface has them):

* the context rows are served as the PyTorch-backend adapter serves them: those at ``input_pos == 0`` attend at
  full precision (causal SDPA on the model-basis ``q, k, v``, one padded call per group of similar lengths:
  ``plugins/trtllm/prefill.py``); one at ``input_pos > 0`` (a later chunk) attends to the slot's cache through
  ``ops.chunk_attention`` (the reference has it; on the GPU the bundle has none and it raises, as the
  PyTorch-backend adapter does); all are then written at ``input_pos`` by one ``ops.write_planned`` (sink, INT2
  pages, recent ring: ``reference.plan_writes``);
* the decode rows take one step: ``ops.decode_step`` (the append, which also rotates the queries into the stored
  key basis) over the committed lengths, then ``ops.decode`` (split-K attention + merge) over the step's lengths;
  the output is ``restore_output`` of it (the exported ``o_proj`` undoes the value rotation);
* a NaN/Inf key or value sets the slot's ``nonfinite`` flag and is not written (a prompt's rows are checked with one
  host read for the batch), and every later row of that sequence writes nothing and returns NaN (AutoDeploy advances
  ``input_pos`` regardless, so the cache would otherwise be read with a hole). The flag is cleared when a row starts
  its sequence (``input_pos == 0``);
* a row that starts its sequence (``input_pos == 0``) starts from zeroed windows: AutoDeploy allocates state
  resources with ``torch.empty`` and hands a finished sequence's slot to the next one, and the attention reads
  every window slot under a mask (a masked NaN left in memory would still give NaN: 0 x NaN);
* rows past ``num_prefill + num_decode`` (padding) return zeros.

The kernels index rows by batch position, so each forward gathers the batch's slot windows into batch rows
(copies; the page pools are shared) and writes them back after the writes. Like upstream's own cached ops
(``custom_ops/attention/torch_backend_attention.py`` @086f0cea writes ``k_cache`` / ``v_cache`` under
``mutates_args=()``), the op writes its cache arguments without declaring them mutated: AutoDeploy owns them as
graph inputs and calls the op once a layer. Host reads: ``batch_info_host`` and ``max_seq_info_host`` (host
tensors) and, for context rows only, their positions; the decode rows' path reads nothing on the host.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from oscar_export.kernels import reference
from oscar_export.kernels.layout import PagedKV
from oscar_export.kernels.pages import STATUS_NONFINITE
from oscar_export.plugins.trtllm.attention import PAGES_PER_SPLIT
from oscar_export.plugins.trtllm.prefill import packed_causal_attention
from oscar_export.plugins.trtllm.reference_ops import one_slot

from .binding import bound
from .metadata import batch_counts, block_table
from .resources import WINDOW_NAMES


@torch.library.custom_op("oscar_ad::cached_attention", mutates_args=())
def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    batch_info_host: torch.Tensor, seq_len: torch.Tensor, input_pos: torch.Tensor, slot_idx: torch.Tensor,
    cu_seqlen: torch.Tensor, cache_loc: torch.Tensor, cu_num_pages: torch.Tensor, max_seq_info_host: torch.Tensor,
    sink_len: torch.Tensor, num_pages: torch.Tensor, recent_len: torch.Tensor,
    step_sink_len: torch.Tensor, step_num_pages: torch.Tensor, step_recent_len: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor,
    k_codes: torch.Tensor, k_params: torch.Tensor, v_codes: torch.Tensor, v_params: torch.Tensor,
    nonfinite: torch.Tensor,
    binding: str, layer: int, scale: float,
) -> torch.Tensor:
    """``q [b, s, H, D]`` (or ``[b, s, H*D]``), ``k, v [b, s, H_kv, D]`` post-RoPE, model basis (bsnd, as the
    source op ``auto_deploy::torch_attention``) -> the attention output in ``q``'s shape and dtype."""
    bd = bound(binding)
    t = bd.transform(layer, q.device)
    ops = bd.ops[layer]
    lay = bd.deployment.layer_layouts[layer]
    h, hkv, d = bd.deployment.num_heads, lay.num_kv_heads, lay.head_dim
    n_pre, n_pre_tok, n_dec = batch_counts(batch_info_host)
    ns = n_pre + n_dec
    out = torch.zeros(q.numel() // (h * d), h, d, dtype=q.dtype, device=q.device)
    if ns == 0:
        return out.view(q.shape)
    slots = slot_idx[:ns].long()
    nonfinite[slots] = torch.where(input_pos[:ns, None] == 0, 0, nonfinite[slots])  # a sequence starts clean
    bt = block_table(cache_loc, cu_num_pages, ns, int(max_seq_info_host.tolist()[1]))
    pools = (k_codes, k_params, v_codes, v_params)
    rows = _batch_rows((sink_k, sink_v, recent_k, recent_v), pools, slots, bt, (sink_len, num_pages, recent_len), ns)
    for name in WINDOW_NAMES:  # a sequence starts from zeroed windows (see the module doc)
        getattr(rows, name).masked_fill_((input_pos[:ns] == 0).view(-1, 1, 1, 1), 0)
    qt, kt, vt = q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if n_pre:
        _context_rows(rows, ops, t, qt, kt, vt, out, seq_len, input_pos, cu_seqlen, nonfinite, slots, n_pre, scale)
    if n_dec:
        step = (step_sink_len[n_pre:ns], step_num_pages[n_pre:ns], step_recent_len[n_pre:ns])
        out[n_pre_tok : n_pre_tok + n_dec] = _decode_rows(rows, ops, t, qt, kt, vt, nonfinite, slots, n_pre, ns,
                                                          n_pre_tok, step).to(q.dtype)
    for name, full in zip(WINDOW_NAMES, (sink_k, sink_v, recent_k, recent_v)):
        full.index_copy_(0, slots, getattr(rows, name))
    return out.view(q.shape)


@cached_attention.register_fake
def _cached_attention_fake(q, k, v, *rest):
    return torch.empty_like(q)


def _batch_rows(windows, pools, slots, bt, lengths, ns) -> PagedKV:
    """A ``PagedKV`` of the batch's ``ns`` rows: the slots' windows gathered (copies), the pools shared, block
    table and committed lengths per row."""
    return PagedKV(*(w.index_select(0, slots) for w in windows), *pools, bt, *(x[:ns] for x in lengths))


def _context_rows(rows, ops, t, q, k, v, out, seq_len, input_pos, cu_seqlen, nonfinite, slots, n_pre, scale) -> None:
    """The context rows together, as the PyTorch-backend adapter serves them (``plugins/trtllm/prefill.py``): the
    first chunks in one padded attention call per group of similar lengths, a later chunk over its cache (one at a
    time), then every row written by one planned write; a row holding a NaN/Inf is flagged."""
    lens, starts, offs = (x[:n_pre].tolist() for x in (seq_len, input_pos, cu_seqlen))
    bad_before = nonfinite[slots[:n_pre], 0].tolist()
    n = offs[-1] + lens[-1]
    k_s = t.transform_keys(k[:n].transpose(0, 1)[None])[0].to(torch.bfloat16)  # [H_kv, n, D] stored basis
    v_s = t.transform_values(v[:n].transpose(0, 1)[None])[0].to(torch.bfloat16)
    first = [(off, m) for m, start, off in zip(lens, starts, offs) if start == 0]
    packed_causal_attention(q[:n], k[:n], v[:n], first, scale, out)
    for i, (m, start, off) in enumerate(zip(lens, starts, offs)):
        if start == 0:
            continue
        if bad_before[i]:  # the sequence lost a token: nothing of it is read or written
            out[off : off + m] = float("nan")
            continue
        if not getattr(ops, "chunked_prefill", False):
            raise NotImplementedError("a prompt chunk after cached tokens: the OSCAR cache ops of this deployment "
                                      "have no kernel for it; turn chunked prefill off")
        sl = slice(off, off + m)
        o = ops.chunk_attention(one_slot(rows, i), q[sl].transpose(0, 1), k_s[:, sl], v_s[:, sl], t)
        out[sl] = t.restore_output(o[None])[0].transpose(0, 1).to(out.dtype)
    width = rows.block_table.shape[1]
    plan = reference.plan_writes(ops.layout, [(i, start, m) for i, (m, start) in enumerate(zip(lens, starts))], width,
                                 q.device)
    bad = reference.nonfinite_rows(plan, k_s, v_s)  # [n_pre] rows holding a NaN/Inf: flagged, not written
    nonfinite[slots[:n_pre], 0] = torch.maximum(nonfinite[slots[:n_pre], 0], bad.to(nonfinite.dtype))
    skip = [bool(x) or bool(start and before) for x, start, before in zip(bad.tolist(), starts, bad_before)]
    if any(skip):  # rare: a row with a NaN/Inf, or a chunk of a flagged sequence
        plan = reference.plan_writes(ops.layout, [(None if skip[i] else i, start, m)
                                                  for i, (m, start) in enumerate(zip(lens, starts))], width, q.device)
    ops.write_planned(rows, plan, k_s, v_s, t)  # one host read for the batch (bad), one write


def _decode_rows(rows, ops, t, q, k, v, nonfinite, slots, n_pre, ns, off, step) -> torch.Tensor:
    """One decode step for rows ``n_pre .. ns - 1`` (tokens ``off ..``): device ops only. Returns ``[g, H, D]``."""
    g, hkv, d = ns - n_pre, k.shape[1], k.shape[2]
    sub = replace(rows, **{f: getattr(rows, f)[n_pre:ns] for f in (*WINDOW_NAMES, "block_table", "sink_len",
                                                                   "num_pages", "recent_len")})
    ks = t.transform_keys(k[off : off + g].view(g, hkv, 1, d)).squeeze(2).to(torch.bfloat16)  # [g, H_kv, D]
    vs = t.transform_values(v[off : off + g].view(g, hkv, 1, d)).squeeze(2).to(torch.bfloat16)
    status = (nonfinite[slots[n_pre:ns], 0] != 0).to(torch.int32) * STATUS_NONFINITE
    q_s = ops.decode_step(sub, ks, vs, status, t, q[off : off + g].to(torch.bfloat16))  # [g, H, D] stored basis
    nonfinite[slots[n_pre:ns], 0] = (status != 0).to(nonfinite.dtype)
    ob = ops.decode(q_s, replace(sub, sink_len=step[0], num_pages=step[1], recent_len=step[2]), t, PAGES_PER_SPLIT)
    og = t.restore_output(ob[:, :, None].float()).squeeze(2)  # [g, H, D] + v_mean
    return torch.where((status != 0)[:, None, None], float("nan"), og)


__all__ = ["cached_attention"]
