"""The context rows of one forward, batched: full-precision causal attention over the packed first chunks
(:func:`packed_causal_attention`) and the OSCAR cache's write plan of every stored row (``reference.plan_writes``,
built once a forward and reused by every layer).

TensorRT-LLM packs the forward's context requests one after another (``q [sum n, H*D]``). A first chunk attends to
its own tokens only; sequences of similar length are padded into one ``scaled_dot_product_attention`` call each
(right padding, ``is_causal``: a real query never sees a padded key), grouped so the padded work is at most
:data:`PADDED_WORK` times the sequences' own, so the launches grow with the spread of lengths, not with the
number of requests.
"""

from __future__ import annotations

import torch

#: the most padded attention work (``sum n_max^2``) a group may do per unit of its sequences' own (``sum n^2``)
PADDED_WORK = 2.0


def length_groups(lengths: list[int], padded_work: float = PADDED_WORK) -> list[list[int]]:
    """Indices of ``lengths`` in groups padded to their longest member at most ``padded_work`` times the work of
    the members' own lengths (longest first; one group when all are equal)."""
    groups: list[list[int]] = []
    own = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            top = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * top * top <= padded_work * (own + lengths[i] ** 2):
                groups[-1].append(i)
                own += lengths[i] ** 2
                continue
        groups.append([i])
        own = lengths[i] ** 2
    return groups


def _to_device(values: list[int], device) -> torch.Tensor:
    """int64 ``values`` on ``device`` through pinned memory (no host synchronisation)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def packed_causal_attention(q, k, v, spans: list[tuple[int, int]], scale: float, out) -> None:
    """Causal attention of each sequence over its own tokens, written into ``out``.

    Args:
        q: ``[T, H, D]`` packed queries; k, v: ``[T, H_kv, D]`` (GQA when ``H_kv < H``).
        spans: ``(offset, n)`` of each sequence in the packing.
        out: ``[T, H, D]``; rows of the spans are written (in ``out``'s dtype), the others left alone.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for group in length_groups([n for _, n in spans]):
        top = spans[group[0]][1]
        if len(group) == 1:
            off, n = spans[group[0]]
            o = sdpa(*(x[off : off + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale,
                     enable_gqa=True)
            out[off : off + n] = o[0].transpose(0, 1).to(out.dtype)
            continue
        pad = q.shape[0]  # index of the zero row appended below
        gather, real = [], []  # padded position -> token (pad: the zero row); the real positions
        for row, i in enumerate(group):
            off, n = spans[i]
            gather += list(range(off, off + n)) + [pad] * (top - n)
            real += range(row * top, row * top + n)
        idx = _to_device(gather + real, q.device)
        gather, real = idx[: len(gather)].view(len(group), top), idx[len(gather) :]
        padded = [torch.cat([x, x.new_zeros(1, *x.shape[1:])])[gather].transpose(1, 2) for x in (q, k, v)]
        o = sdpa(*padded, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)  # [g, top, H, D]
        out[gather.flatten()[real]] = o.flatten(0, 1)[real].to(out.dtype)

__all__ = ["PADDED_WORK", "length_groups", "packed_causal_attention"]
