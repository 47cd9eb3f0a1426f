"""Fake-quantized attention for the evaluation, registered with transformers' ``AttentionInterface``.

One forward pass scores a whole text decode-as-deployed: inside every attention call each query row reads
what the method's cache would hold at that position (``cache_models``: quantized rows where the cache holds
INT2, full-precision rows elsewhere). Runs on the model's device (CPU or CUDA). The per-call state travels in
the forward kwargs
(``model(ids, oscar_eval=ctx)``), never in module globals.

``EvalContext`` modes:

``score``    the keys in the call are the whole sequence (no HF cache); batch row ``b`` uses ``methods[b]``.
``prefill``  full precision; the call's keys are appended to the shared prefix kept in the context.
``decode``   batch row ``b`` (method ``methods[b // fold]``, prompt ``b % fold``) reads its prompt's prefix +
             its own generated tokens + the new ones; new tokens are kept per row. The ``fold`` prompts of
             one method (equal lengths) are folded into the KV-head axis, so one method costs the same
             number of ops for 1 or 20 prompts (``CacheModel.fold``). ``prefill_len`` is the prompt
             length the HF ``QuantizedCache`` replay treats as its first update.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .cache_models import BF16Cache, CacheModel, Segment

ATTENTION_NAME = "oscar_eval"
FULL = BF16Cache("full precision")
MODES = ("score", "prefill", "decode")
#: query rows per attention block (bounds the [H, rows, Tk] score buffer).
QUERY_BLOCK = 256


@dataclass
class EvalContext:
    """Per-run state of the fake-quantized attention (see module doc).

    Args:
        methods: one method per batch row (``prefill`` ignores them: full precision).
        mode: one of ``MODES``.
        store_dtype: dtype every cached row is rounded to (``torch.bfloat16``: a BF16 cache).
        prefill_len: ``decode``: the prompt length (first ``QuantizedCache`` update); ``score``: 1.
    """

    methods: list[CacheModel]
    mode: str = "score"
    store_dtype: torch.dtype = torch.bfloat16
    prefill_len: int = 1
    fold: int = 1  # decode: prompts per method, folded into the KV-head axis (batch row = method * fold + prompt)
    prefix_k: dict[int, torch.Tensor] = field(default_factory=dict)  # [1, fold * H_kv, n, D] model basis
    prefix_v: dict[int, torch.Tensor] = field(default_factory=dict)
    gen_k: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, H_kv, t, D]
    gen_v: dict[int, torch.Tensor] = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    capture: dict | None = None  # layer -> [(q [H, T, D], k, v)] when set (research-recipe statistics)
    #: decode: ``[fold, W]`` long token positions per prompt whose attention mass to record (-1 = padding);
    #: each decode step appends ``[fold * H]`` float32 (mass summed over the positions) to ``mass[(method, layer)]``.
    watch: torch.Tensor | None = None
    mass: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"EvalContext.mode: expected one of {MODES}, got {self.mode!r}")

    @property
    def prefix_len(self) -> int:
        return next(iter(self.prefix_k.values())).shape[2] if self.prefix_k else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` prefix tokens; drop generated tokens and memoised quantizations."""
        for d in (self.prefix_k, self.prefix_v):
            for i in d:
                d[i] = d[i][:, :, :length]
        self.gen_k.clear()
        self.gen_v.clear()
        self.memo.clear()


def eval_mask(*args, **kwargs):
    """Mask function: none (the attention builds its causal rule per query position)."""
    return None


def register() -> None:
    """Register ``"oscar_eval"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, eval_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eval_mask)


@contextlib.contextmanager
def evaluating(model):
    """Switch ``model`` to the ``oscar_eval`` attention for the duration of the block."""
    register()
    old = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(old or "sdpa")


def eval_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, oscar_eval=None,
                   **kwargs):
    """``AttentionInterface`` function. ``query [B, H, Tq, D]``, ``key/value [B, H_kv, Tq, D]`` (new tokens).

    Returns ``([B, Tq, H, D], None)``.
    """
    ctx: EvalContext = oscar_eval
    if ctx is None:
        raise ValueError("oscar_eval attention: call the model with oscar_eval=EvalContext(...)")
    layer = module.layer_idx
    if ctx.capture is not None:
        ctx.capture.setdefault(layer, []).append((query[0].float(), key[0].float(), value[0].float()))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    b = query.shape[0]
    outs = []
    if ctx.mode == "prefill":
        if b != 1:
            raise ValueError(f"oscar_eval prefill: expected batch 1, got {b}")
        k = torch.cat([ctx.prefix_k[layer], key], 2) if layer in ctx.prefix_k else key
        v = torch.cat([ctx.prefix_v[layer], value], 2) if layer in ctx.prefix_v else value
        ctx.prefix_k[layer], ctx.prefix_v[layer] = k, v
        outs.append(sequence_attention(ctx, FULL, -1, layer, query[0], k[0], v[0], scale))
    else:
        f = ctx.fold if ctx.mode == "decode" else 1
        if b != len(ctx.methods) * f:
            raise ValueError(f"oscar_eval: batch {b} but {len(ctx.methods)} methods x {f} prompts")
        if ctx.mode == "decode":
            gk = torch.cat([ctx.gen_k[layer], key], 2) if layer in ctx.gen_k else key
            gv = torch.cat([ctx.gen_v[layer], value], 2) if layer in ctx.gen_v else value
            ctx.gen_k[layer], ctx.gen_v[layer] = gk, gv
        for i, m in enumerate(ctx.methods):
            if ctx.mode == "decode":  # rows i*f .. i*f+f-1: this method's prompts, folded into the heads
                rows = slice(i * f, (i + 1) * f)
                fold = lambda x: x[rows].reshape(-1, *x.shape[2:])  # noqa: E731  [f, H, T, D] -> [f*H, T, D]
                o = sequence_attention(ctx, m, i, layer, fold(query), fold(gk), fold(gv), scale)
                outs += list(o.view(f, -1, *o.shape[1:]))
            else:
                outs.append(sequence_attention(ctx, m, i, layer, query[i], key[i], value[i], scale))
    out = torch.stack(outs, 0).to(query.dtype)  # [B, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None


def sequence_attention(ctx: EvalContext, m: CacheModel, mi: int, layer: int, q, k, v, scale: float) -> torch.Tensor:
    """The attention of one sequence (batch row) as method ``m`` (index ``mi`` in ``ctx.methods``; -1: full precision)
    caches it: ``q [H, Tq, D]``, ``k, v [H_kv, Tk, D]`` (model basis; in ``decode`` only the generated rows, the
    prompt's are the context's prefix) -> ``[H, Tq, D]`` float32."""
    tq = q.shape[1]
    if ctx.mode == "decode" and mi >= 0:
        t, ks, vs, segs = _decode_rows(ctx, m, mi, layer, k, v)
    else:
        t, ks, vs = m.stored_rows(layer, k, v, ctx.store_dtype)
        segs = m.segments(layer, ks, vs, k.shape[1] - tq, k.shape[1], ctx.prefill_len)
    q_start = ks.shape[1] - tq
    watch = None
    if ctx.mode == "decode" and mi >= 0 and ctx.watch is not None:  # [fold, W] -> one row per folded KV head
        watch = ctx.watch.to(q.device).repeat_interleave(k.shape[0] // ctx.watch.shape[0], 0)
    qs = t.transform_queries(q.unsqueeze(0).contiguous())[0] if t is not None else q.float()
    h, hkv, d = q.shape[0], k.shape[0], q.shape[2]
    g = h // hkv
    qs = qs.view(hkv, g, tq, d)
    out = torch.empty(hkv, g, tq, d, device=q.device)
    for seg in segs:
        for a0 in range(max(seg.start, q_start), seg.end, QUERY_BLOCK):
            a1 = min(a0 + QUERY_BLOCK, seg.end)
            r0, r1 = a0 - q_start, a1 - q_start
            out[:, :, r0:r1], m = _attend(qs[:, :, r0:r1], ks[:, :a1], vs[:, :a1], seg, a0, a1, scale, watch)
            if m is not None:
                ctx.mass.setdefault((mi, layer), []).append(m.reshape(-1))  # [H_kv * g] = [fold * H]
    out = out.view(1, h, tq, d)
    if t is not None:
        out = t.restore_output(out)
    return out[0]


@dataclass
class _DecodeRows:
    """Per method and layer in ``decode``: stored rows of prompt + generated tokens (a growing buffer) and
    the segments built when the prompt was prefilled (reused until ``valid_until``)."""

    transform: object
    ks: torch.Tensor  # [H_kv, capacity, D]
    vs: torch.Tensor
    n: int
    segs: list


def _decode_rows(ctx: EvalContext, m: CacheModel, mi: int, layer: int, gk, gv):
    """``gk, gv [H_kv, t, D]``: the generated rows so far (model basis). Returns ``(transform, ks, vs, segs)``
    over the ``n0 + t`` rows; the prompt's rows and quantization are computed once per prompt."""
    n0 = ctx.prefix_len
    tk = n0 + gk.shape[1]
    st: _DecodeRows | None = ctx.memo.get((mi, layer))
    if st is None:
        t, ks0, vs0 = m.stored_rows(layer, ctx.prefix_k[layer][0], ctx.prefix_v[layer][0], ctx.store_dtype)
        segs = m.segments(layer, ks0, vs0, n0, n0 + 1, ctx.prefill_len)
        st = _DecodeRows(t, ks0, vs0, n0, segs)
        ctx.memo[(mi, layer)] = st
    if tk > st.ks.shape[1]:  # grow the buffer (amortised: by 64 rows at least)
        grow = max(64, tk - st.ks.shape[1])
        pad = st.ks.new_empty(st.ks.shape[0], grow, st.ks.shape[2])
        st.ks, st.vs = torch.cat([st.ks, pad], 1), torch.cat([st.vs, pad.clone()], 1)
    if tk > st.n:
        _, ks1, vs1 = m.stored_rows(layer, gk[:, st.n - n0 :], gv[:, st.n - n0 :], ctx.store_dtype)
        st.ks[:, st.n : tk], st.vs[:, st.n : tk] = ks1, vs1
        st.n = tk
    ks, vs = st.ks[:, :tk], st.vs[:, :tk]
    last = st.segs[-1]
    if tk - 1 >= last.valid_until:  # a page was demoted / a group flushed since the prompt: quantize again
        st.segs = m.segments(layer, ks, vs, tk - 1, tk, ctx.prefill_len)
        last = st.segs[-1]
    return st.transform, ks, vs, [Segment(tk - 1, tk, last.c0, last.k_alt, last.v_alt, last.ranges, last.valid_until)]


def _attend(qs, ks, vs, seg: Segment, a0: int, a1: int, scale: float, watch: torch.Tensor | None = None):
    """Queries at positions ``[a0, a1)``: ``qs [H_kv, g, n, D]`` over ``ks, vs [H_kv, a1, D]``
    -> ``([H_kv, g, n, D], mass)``; ``mass [H_kv, g, n]``: the attention summed over the columns ``watch [H_kv, W]``
    (-1 = none), or None without ``watch``."""
    hkv, g, n, d = qs.shape
    dev = qs.device
    q2 = qs.reshape(hkv, g * n, d)
    s = torch.matmul(q2, ks.transpose(-1, -2)).view(hkv, g, n, a1)
    pos = torch.arange(a0, a1, device=dev)
    alt = seg.k_alt is not None
    c1 = c0 = seg.c0
    if alt:
        lo, k_hi, v_hi = seg.ranges(pos)
        c1 = min(c0 + seg.k_alt.shape[1], a1)
        cols = torch.arange(c0, c1, device=dev)
        if c1 > c0:
            mk = (cols[None] >= lo[:, None]) & (cols[None] < k_hi[:, None])  # [n, c]
            sq = torch.matmul(q2, seg.k_alt[:, : c1 - c0].transpose(-1, -2)).view(hkv, g, n, c1 - c0)
            s[..., c0:c1] = torch.where(mk, sq, s[..., c0:c1])
    causal = torch.arange(a1, device=dev)[None, :] > pos[:, None]  # [n, a1]
    s = (s * scale).masked_fill(causal, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p.view(hkv, g * n, a1), vs)
    if alt and c1 > c0:
        mv = ((cols[None] >= lo[:, None]) & (cols[None] < v_hi[:, None])).float()  # [n, c]
        pv = (p[..., c0:c1] * mv).reshape(hkv, g * n, c1 - c0)
        o = o + torch.matmul(pv, seg.v_alt[:, : c1 - c0] - vs[:, c0:c1])
    mass = None
    if watch is not None:
        idx = watch.clamp(0, a1 - 1).view(hkv, 1, 1, -1).expand(hkv, g, n, watch.shape[1])
        ok = ((watch >= 0) & (watch < a1)).view(hkv, 1, 1, -1)
        mass = (p.gather(-1, idx) * ok).sum(-1)
    return o.view(hkv, g, n, d), mass


__all__ = ["ATTENTION_NAME", "EvalContext", "MODES", "eval_attention", "evaluating", "register", "sequence_attention"]
