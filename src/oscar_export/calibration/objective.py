"""The attention-aware error of a candidate transform, measured with the exact reference quantizer.

Held-out rows of one layer (:class:`capture.HeldOut`) are put in the stored basis by the candidate
(rotation ``R``, scaling ``d``, mean ``mu``), cut into pages of ``P`` tokens starting after the sink,
quantized and dequantized by ``kernels.reference.quantize_pages`` / ``dequantize_pages`` with the real
``RowFormat`` (token or channel granularity), clip ratios and levels — so the error fitted here is the
error serving makes. Per KV head:

    key error    E_t[ (Δk_t^T C_Q Δk_t) ] * scaling^2    = mean over held-out query/key pairs of the squared
                 score error (q·k_hat - q·k)^2 / D, with C_Q the held-out queries' second moment
                 (q and Δk taken in the stored basis: q R / d and Δ(k R d - mu)).
    value error  E_i[ ||Σ_t p_{i,t} Δv_t||^2 ]            over held-out queries i (all g query heads) and the
                 quantized tokens t < i - W (W the BF16 recent window, optional), p the full-precision causal
                 attention probabilities (of the whole sequence, sink and window included); Δv in the
                 model basis (Δv_s / d, rotated back; R orthogonal so the norm needs no R).

The key error is an exact quadratic form of the pooled data (``C_Q`` ``[H_kv, D, D]`` is built once: one
quantization and one small matmul per evaluation). The value error is ``||P Δv||^2`` with the value queries'
probabilities ``P`` built once, in blocks that keep only the rows their queries read (:func:`value_queries`).
The same error over every ``SCREEN_STRIDE``-th query position (``screen=True``, an eighth of the cost) ranks a clip
grid for the fit (``clipping.fit_clip``), which then measures the best ranked clips with every query: alone it chose
other value fits in 2 of 6 SmolLM2 layers (held-out value error +0.9 % / +1.6 % there), as a screen the exact best
clip was among its best 3 in 359 of 360 grids and the artifact the same to the bit (benchmarks/RESULTS-calibrate.md).
The groups' sorted ``|x|`` is computed once for all the clips of a grid, down to the lowest rank they keep
(:func:`roundtrip`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oscar_export.kernels.layout import RowFormat
from oscar_export.kernels.reference import dequantize_groups, quantize_groups
from oscar_export.kernels.transform import clip_rank

from .capture import HeldOut
from .covariance import group_queries


@dataclass
class LayerObjective:
    """Held-out data of one layer, prepared for fast evaluation.

    Attributes:
        k: ``[N, H_kv, T_q, D]`` fp64 rows of the quantized region (T_q = pages * P).
        v: ``[N, H_kv, T_v, D]`` fp64, the first ``T_v <= T_q`` of those rows: the pages some query reads.
        c_q: ``[H_kv, D, D]`` fp64 held-out query second moment (all g query heads).
        p: per sequence, the value queries' attention probabilities over those rows (:func:`value_queries`): blocks
            ``[H_kv, rows, c]`` fp32 over the first ``c`` rows (the rows the block's queries read), all blocks'
            rows together ``count`` (query positions x query heads).
        scaling: softmax scale.
        p_screen, count_screen: ``p`` and ``count`` of every ``SCREEN_STRIDE``-th query position (rows of ``p``).
    """

    k: torch.Tensor
    v: torch.Tensor
    c_q: torch.Tensor
    p: list[list[torch.Tensor]]
    count: int
    scaling: float
    page_size: int
    p_screen: list[list[torch.Tensor]] = field(default_factory=list)
    count_screen: int = 0

    @classmethod
    def build(cls, held: HeldOut, skip: int, page_size: int, window: int = 0) -> "LayerObjective":
        """``window``: query ``i`` reads token ``t`` quantized only when ``i - t > window`` (the BF16 recent
        window of serving); 0 treats every earlier token as quantized."""
        n, h, t, d = held.q.shape
        hkv = held.k.shape[1]
        pages = (t - skip) // page_size
        if pages <= 0:
            raise ValueError(
                f"held-out sequences of {t} tokens hold no {page_size}-token page after the {skip}-token sink: "
                f"use seq_len >= {skip + page_size}"
            )
        lo, hi = skip, skip + pages * page_size
        if window > 0 and t - 1 - lo <= window:
            raise ValueError(f"held-out sequences of {t} tokens have no token beyond the {window}-token window")
        qs = held.q[:, :, skip:].double().reshape(n, hkv, -1, d)  # [N, H_kv, g*(T-skip), D]
        c_q = torch.einsum("nhid,nhie->hde", qs, qs) / (n * qs.shape[2])
        # Values: only the pages some query reads outside its window matter (M is zero elsewhere).
        vpages = pages if window <= 0 else min(pages, -(-(t - 1 - window - lo) // page_size))
        p, count = value_queries(held.q, held.k, held.scaling, lo, vpages * page_size, window)
        g = count // (t - lo)
        screen = [[pb.view(hkv, -1, g, pb.shape[-1])[:, ::SCREEN_STRIDE].reshape(hkv, -1, pb.shape[-1]).contiguous()
                   for pb in blocks] for blocks in p]  # rows ordered (position, head); blocks start at multiples
        return cls(held.k[:, :, lo:hi].double(), held.v[:, :, lo : lo + vpages * page_size].double(), c_q, p, count,
                   held.scaling, page_size, screen, g * len(range(lo, t, SCREEN_STRIDE)))

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    # ---- the two errors ----------------------------------------------------------------------------------
    def _pages(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, H_kv, T_q, D]`` -> ``[N * pages, H_kv, P, D]`` fp32."""
        n, h, tq, d = x.shape
        p = self.page_size
        return x.float().reshape(n, h, tq // p, p, d).transpose(1, 2).reshape(-1, h, p, d)

    def _unpages(self, x: torch.Tensor, n: int) -> torch.Tensor:
        _, h, p, d = x.shape
        return x.reshape(n, -1, h, p, d).transpose(1, 2).reshape(n, h, -1, d)

    def _quant_errors(
        self, x: torch.Tensor, fmt: RowFormat, clips: list[torch.Tensor], levels: torch.Tensor
    ) -> list[torch.Tensor]:
        """``x [N, H_kv, T_q, D]`` stored basis -> ``[x_hat - x]`` (fp32) for each ``clip [H_kv]`` of ``clips``.

        ``x_hat`` is bit-identical to ``dequantize_pages(*quantize_pages(pages, fmt, clip, levels), fmt, levels)``
        (tested).
        """
        n = x.shape[0]
        pages = self._pages(x)
        return [self._unpages(xh - pages, n) for xh in roundtrip(pages, fmt, clips, levels)]

    def key_errors(
        self, r: torch.Tensor, d: torch.Tensor, mu: torch.Tensor, clips: list[torch.Tensor], levels: torch.Tensor,
        fmt: RowFormat,
    ) -> torch.Tensor:
        """``[len(clips), H_kv]`` mean squared score error of keys stored as ``k R d - mu``.

        ``r [H, D, D]``, ``d, mu [H, D]`` fp64; ``clips``: ``[H]`` clip ratios to try; ``levels [H, 4]``.
        """
        ks = torch.matmul(self.k, r.double().unsqueeze(0)) * d.double()[None, :, None] - mu.double()[None, :, None]
        cqs = r.double().transpose(-1, -2) @ self.c_q @ r.double()
        cqs = (cqs / d.double()[:, :, None] / d.double()[:, None, :]).float().unsqueeze(0)
        out = []
        for delta in self._quant_errors(ks, fmt, clips, levels):  # fp32: the error's precision is ample
            e = (torch.matmul(delta, cqs) * delta).sum(dim=(0, 2, 3), dtype=torch.float64)
            out.append(e / (delta.shape[0] * delta.shape[2]) * self.scaling**2)
        return torch.stack(out)

    def value_errors(
        self, r: torch.Tensor, d: torch.Tensor, mu: torch.Tensor, clips: list[torch.Tensor], levels: torch.Tensor,
        fmt: RowFormat, screen: bool = False,
    ) -> torch.Tensor:
        """``[len(clips), H_kv]`` mean squared attention-output error of values stored as ``v R d - mu``
        (``screen``: over every ``SCREEN_STRIDE``-th query position only)."""
        vs = torch.matmul(self.v, r.double().unsqueeze(0)) * d.double()[None, :, None] - mu.double()[None, :, None]
        p, count = (self.p_screen, self.count_screen) if screen else (self.p, self.count)
        return torch.stack([self._output_energy(delta / d.float()[None, :, None], p, count)
                            for delta in self._quant_errors(vs, fmt, clips, levels)])  # [R, H_kv]

    def key_error(self, r, d, mu, clip, levels, fmt) -> torch.Tensor:
        """``[H_kv]``: :meth:`key_errors` for one clip vector."""
        return self.key_errors(r, d, mu, [clip], levels, fmt)[0]

    def value_error(self, r, d, mu, clip, levels, fmt) -> torch.Tensor:
        """``[H_kv]``: :meth:`value_errors` for one clip vector."""
        return self.value_errors(r, d, mu, [clip], levels, fmt)[0]

    def key_scale(self) -> torch.Tensor:
        """``[H_kv]`` mean squared score ``E[(q·k)^2] scaling^2`` (to state errors relative to the signal)."""
        e = torch.einsum("nhtd,hde,nhte->h", self.k, self.c_q, self.k) / (self.k.shape[0] * self.k.shape[2])
        return e * self.scaling**2

    def value_scale(self) -> torch.Tensor:
        """``[H_kv]`` mean squared output norm carried by the quantized tokens, ``E||Σ_t p_t v_t||^2``."""
        return self._output_energy(self.v.float(), self.p, self.count)

    @staticmethod
    def _output_energy(x: torch.Tensor, p: list[list[torch.Tensor]], count: int) -> torch.Tensor:
        """``[H_kv]`` ``E_i ||Σ_t p_{i,t} x_t||^2`` of rows ``x [N, H_kv, T_v, D]`` fp32, over the value queries of
        ``p`` (``count`` a sequence; each sequence's mean, then the mean over sequences)."""
        out = torch.zeros(x.shape[1], dtype=torch.float64)
        for xs, blocks in zip(x, p):
            for pb in blocks:  # [H_kv, rows, c]: the block's queries read only the first c rows
                y = torch.matmul(pb, xs[:, : pb.shape[-1]])  # [H_kv, rows, D]
                out += (y * y).sum(dim=(-1, -2), dtype=torch.float64)
        return out / (count * x.shape[0])


#: query positions per block of :func:`value_queries`.
VALUE_BLOCK = 256
#: the value screen's query positions: every ``SCREEN_STRIDE``-th (a divisor of ``VALUE_BLOCK``).
SCREEN_STRIDE = 8


@torch.no_grad()
def value_queries(q: torch.Tensor, k: torch.Tensor, scaling: float, lo: int, tv: int, window: int = 0,
                  block: int = VALUE_BLOCK) -> tuple[list[list[torch.Tensor]], int]:
    """The attention probabilities ``p_i`` of the value queries over the rows ``[lo, lo + T_v)``, in blocks.

    Value queries: every position in ``[lo, T)``, each with every query head of the KV head. ``p_i`` is the query's
    causal softmax attention (over all earlier positions, sink and window included) restricted to those rows, zero where
    ``i - t <= window`` (with ``window > 0``: the BF16 recent window). Computed a sequence and a block of positions at a
    time (never the ``[T, T]`` probabilities of every head at once); a block keeps only the first ``c`` rows, the ones
    its queries read (the staircase of the causal window), so ``||P x||^2`` costs about half of the full product.

    Args:
        q: ``[N, H, T, D]``; k: ``[N, H_kv, T, D]`` (model basis, post-RoPE).
    Returns:
        per sequence a list of blocks ``[H_kv, g * positions, c]`` fp32 (rows ordered position, head), and the
        number of query rows of a sequence.
    """
    n, h, t, _ = q.shape
    hkv = k.shape[1]
    g = h // hkv
    shift = window if window > 0 else -1  # query i reads row r when i - r > shift
    pos = torch.arange(lo, t)
    out = []
    for b in range(n):
        blocks = []
        for part in pos.split(block):
            e = int(part[-1]) + 1
            cols = max(0, min(e - 1 - shift - lo, tv))  # rows the block's last (latest) query reads
            if cols == 0:
                continue
            qb = group_queries(q[b : b + 1, :, part].float(), hkv)[0]  # [H_kv, g*B, D]
            s = torch.matmul(qb, k[b, :, :e].float().transpose(-1, -2)).view(hkv, g, len(part), e) * scaling
            s.masked_fill_(part[:, None] < torch.arange(e)[None, :], float("-inf"))
            pr = torch.softmax(s, dim=-1)[..., lo : lo + cols]  # [H_kv, g, B, cols]
            pr = pr * (part[:, None] - torch.arange(lo, lo + cols)[None, :] > shift)
            blocks.append(pr.transpose(1, 2).reshape(hkv, -1, cols).contiguous())
        out.append(blocks)
    return out, g * len(pos)


def roundtrip(
    pages: torch.Tensor, fmt: RowFormat, clips: list[torch.Tensor], levels: torch.Tensor
) -> list[torch.Tensor]:
    """``x_hat`` (fp32) of ``pages [N, H_kv, P, D]`` for every ``clip [H_kv]``, through the reference quantizer.

    ``kernels.reference.quantize_groups`` + ``dequantize_groups`` on the groups ``fmt`` defines (the codes are
    not packed: packing is lossless), one call per clip ratio.
    """
    n, h, p, d = pages.shape
    if fmt.granularity == "token":
        g = fmt.group_size
        x = pages.float().reshape(n, h, p, d // g, g)
        lv = levels.float().view(1, h, 1, 1, 4)
        view, size = (1, h, 1, 1, 1), g
    else:
        x = pages.float().transpose(-1, -2)  # [N, H, D, P]
        lv = levels.float().view(1, h, 1, 4)
        view, size = (1, h, 1, 1), p
    out = []
    ranks = [clip_rank(clip.to(x.device), size).view(view) for clip in clips]
    # The groups' largest |x| down to the lowest rank a clip keeps, once for every clip, descending: quantize_groups
    # reads sorted_abs[rank] (ascending), which is top[size - 1 - rank].
    top = x.abs().topk(size - int(min(r.min() for r in ranks)), dim=-1).values
    for rank in ranks:
        codes, scale, lo = quantize_groups(x, size - 1 - rank, lv, sorted_abs=top)
        xh = dequantize_groups(codes, scale, lo, lv)
        out.append(xh.reshape(n, h, p, d) if fmt.granularity == "token" else xh.transpose(-1, -2))
    return out


__all__ = ["SCREEN_STRIDE", "VALUE_BLOCK", "LayerObjective", "roundtrip", "value_queries"]
