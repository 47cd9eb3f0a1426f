"""transformers' ``QuantizedCache`` as a cache model (:class:`HFQuantized`): its update rule replayed.

The real backend layer's (HQQ or quanto, any ``nbits``) ``_quantize``/``_dequantize`` and its ``update`` rule:
the first update (``prefill_len`` tokens) is quantized whole; later tokens wait in a full-precision residual until
``residual + 1 >= R``, then everything (dequantized history + residual) is quantized again (:func:`hf_flushes`:
the cache states a sequence goes through). One :class:`~.cache_models.Segment` per cache state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from .cache_models import CacheModel, Segment, check_length
from .quantizers import HF_BACKENDS, hf_backend_layer


@dataclass(frozen=True, eq=False)
class HFQuantized(CacheModel):
    """transformers' ``QuantizedCache(backend=..., nbits=...)`` at its defaults (group 64, residual 128)."""

    backend: str = "quanto"
    nbits: int = 2
    group: int = 64
    residual: int = 128
    prompts: int = 1  # folded prompts (see ``fold``): each is replayed alone, as a batch-1 cache would be

    kind: ClassVar[str] = "hf"

    def __post_init__(self) -> None:
        if self.backend not in HF_BACKENDS:
            raise ValueError(f"HFQuantized.backend: expected one of {HF_BACKENDS}, got {self.backend!r}")
        if self.nbits not in (2, 4) or self.group <= 0 or self.residual <= 0:
            raise ValueError(f"HFQuantized {self.name!r}: expected nbits 2 or 4 and positive group/residual")

    def bits_per_element(self, length: int) -> float:
        """Codes + a 16-bit scale and zero point per group (as in a BF16/FP16 deployment; HQQ and quanto keep
        params in the compute dtype); the full-precision residual at 16 bits."""
        check_length(length)
        per = self.nbits + 2 * 16.0 / self.group
        q = hf_quantized_count(1, length, self.residual)
        return (q * per + (length - q) * 16.0) / length

    def fold(self, prompts: int) -> "HFQuantized":
        return replace(self, prompts=prompts)

    def _segments(self, layer, ks, vs, q_start, q_end, prefill_len):
        if self.prompts == 1:
            return self._replay(layer, ks, vs, q_start, q_end, prefill_len)
        parts = [self._replay(layer, k, v, q_start, q_end, prefill_len)
                 for k, v in zip(ks.chunk(self.prompts, 0), vs.chunk(self.prompts, 0))]
        out = []
        for segs in zip(*parts):  # equal lengths: the same states for every prompt
            s0 = segs[0]
            alt = s0.k_alt is not None
            out.append(Segment(s0.start, s0.end, s0.c0, torch.cat([s.k_alt for s in segs]) if alt else None,
                               torch.cat([s.v_alt for s in segs]) if alt else None, s0.ranges, s0.valid_until))
        return out

    def _replay(self, layer, ks, vs, q_start, q_end, prefill_len):
        x_k, x_v = ks.unsqueeze(0), vs.unsqueeze(0)  # [1, H_kv, Tk, D], the layout HF's layers quantize
        hl = hf_backend_layer(self.backend, self.nbits, self.group, self.residual, x_k[:, :, :1])
        segs = [Segment(q_start, min(prefill_len, q_end), valid_until=prefill_len)] if q_start < prefill_len else []
        states = [st for st in hf_flushes(prefill_len, q_end, self.residual) if st[1] <= ks.shape[1]]
        dq_k = dq_v = None
        for i, (start, count) in enumerate(states):
            end = states[i + 1][0] if i + 1 < len(states) else q_end
            src_k = x_k[:, :, :count] if dq_k is None else torch.cat([dq_k, x_k[:, :, dq_k.shape[2]:count]], 2)
            src_v = x_v[:, :, :count] if dq_v is None else torch.cat([dq_v, x_v[:, :, dq_v.shape[2]:count]], 2)
            dq_k = hl._dequantize(hl._quantize(src_k.contiguous(), axis=hl.axis_key)).float()
            dq_v = hl._dequantize(hl._quantize(src_v.contiguous(), axis=hl.axis_value)).float()
            if end <= max(start, q_start):
                continue

            def ranges(pos, c=count):
                z = torch.zeros_like(pos)
                return z, z + c, z + c

            # the next flush takes effect R tokens after this state's first query
            segs.append(Segment(max(start, q_start), end, 0, dq_k[0], dq_v[0], ranges, start + self.residual))
        return segs

    def _reads_quantized(self, pos, prefill_len):
        return pos >= prefill_len


def hf_quantized_count(prefill_len: int, length: int, residual: int) -> int:
    """Tokens held quantized by ``QuantizedCache`` after a ``prefill_len`` update then single-token updates."""
    return hf_flushes(prefill_len, length, residual)[-1][1] if length > prefill_len else min(prefill_len, length)


def hf_flushes(prefill_len: int, length: int, residual: int) -> list[tuple[int, int]]:
    """``[(first query position, quantized count)]``: the cache states a ``length``-token sequence goes through.

    State 0 is the prefill: ``prefill_len`` tokens quantized, read by queries from ``prefill_len`` on (the
    prefill queries themselves attend at full precision). The query at which the residual fills still reads
    the old state; the flush takes effect from the next position.
    """
    states = [(prefill_len, prefill_len)]
    res = 0
    for a in range(prefill_len, length):
        if res + 1 >= residual:
            states.append((a + 1, a + 1))
            res = 0
        else:
            res += 1
    return states


__all__ = ["HFQuantized", "hf_flushes", "hf_quantized_count"]
