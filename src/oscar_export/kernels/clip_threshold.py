"""The clip threshold of the quantizer on the GPU: the K-th largest ``|x|`` of each group, exactly.

The quantizer (``reference.groups``) clips each group at ``sorted(|x|)[rank]``, i.e. its K-th largest ``|x|``
with ``K = group - rank``. These Triton helpers find it without sorting the group: each thread keeps the 8
largest values it has seen as a descending list in registers, the threads sharing a group merge their lists,
and more rounds below a cut handle K > 8 (:func:`resolve`; :func:`prep` masks a round's values below its
cut). Used by the quantizer's passes, :mod:`.quant_token` and :mod:`.quant_channel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The clip threshold: sorted(|x|)[rank] of each group, i.e. the K-th largest |x| with K = removals + 1.
# Each thread keeps, per group it owns, the 8 largest |x| it has seen as a descending list in registers
# (8 new values: a sorting network, then a bitonic merge into the list; one value: insertion), the lists
# of the threads sharing a group are merged by a tl.reduce (the same bitonic merge), and the threshold is
# the list's K-th entry. Ties need no
# care: the list is a multiset. K > 8 (clip ratios below ~0.94 at G = 128) takes more rounds over the
# group: round r keeps the 8 largest |x| below the previous round's 8th (the cut) and counts the values in
# [cut, previous cut) it removes; each round removes >= 8 values or ends. Min and max of x come from the
# first round: clamp is monotone, so min(clamp(x)) == clamp(min(x)) exactly.


@triton.jit
def ins(t0, t1, t2, t3, t4, t5, t6, t7, v):
    """Insert ``v`` into the descending lists ``t0 >= ... >= t7`` (elementwise); the smallest falls off."""
    h = tl.maximum(t0, v)
    v = tl.minimum(t0, v)
    t0 = h
    h = tl.maximum(t1, v)
    v = tl.minimum(t1, v)
    t1 = h
    h = tl.maximum(t2, v)
    v = tl.minimum(t2, v)
    t2 = h
    h = tl.maximum(t3, v)
    v = tl.minimum(t3, v)
    t3 = h
    h = tl.maximum(t4, v)
    v = tl.minimum(t4, v)
    t4 = h
    h = tl.maximum(t5, v)
    v = tl.minimum(t5, v)
    t5 = h
    h = tl.maximum(t6, v)
    v = tl.minimum(t6, v)
    t6 = h
    t7 = tl.maximum(t7, v)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def merge8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """The 8 largest of two descending 8-lists, descending (``tl.reduce`` combine: associative, commutative).

    ``max(a_i, b_{7-i})`` holds the 8 largest as a bitonic sequence; a bitonic merger sorts it.
    """
    m0 = tl.maximum(a0, b7)
    m1 = tl.maximum(a1, b6)
    m2 = tl.maximum(a2, b5)
    m3 = tl.maximum(a3, b4)
    m4 = tl.maximum(a4, b3)
    m5 = tl.maximum(a5, b2)
    m6 = tl.maximum(a6, b1)
    m7 = tl.maximum(a7, b0)
    m0, m4 = tl.maximum(m0, m4), tl.minimum(m0, m4)
    m1, m5 = tl.maximum(m1, m5), tl.minimum(m1, m5)
    m2, m6 = tl.maximum(m2, m6), tl.minimum(m2, m6)
    m3, m7 = tl.maximum(m3, m7), tl.minimum(m3, m7)
    m0, m2 = tl.maximum(m0, m2), tl.minimum(m0, m2)
    m1, m3 = tl.maximum(m1, m3), tl.minimum(m1, m3)
    m4, m6 = tl.maximum(m4, m6), tl.minimum(m4, m6)
    m5, m7 = tl.maximum(m5, m7), tl.minimum(m5, m7)
    m0, m1 = tl.maximum(m0, m1), tl.minimum(m0, m1)
    m2, m3 = tl.maximum(m2, m3), tl.minimum(m2, m3)
    m4, m5 = tl.maximum(m4, m5), tl.minimum(m4, m5)
    m6, m7 = tl.maximum(m6, m7), tl.minimum(m6, m7)
    return m0, m1, m2, m3, m4, m5, m6, m7


@triton.jit
def _sort8(e0, e1, e2, e3, e4, e5, e6, e7):
    """Descending sort of 8 values (elementwise): a 19-comparator network."""
    e0, e2 = tl.maximum(e0, e2), tl.minimum(e0, e2)
    e1, e3 = tl.maximum(e1, e3), tl.minimum(e1, e3)
    e4, e6 = tl.maximum(e4, e6), tl.minimum(e4, e6)
    e5, e7 = tl.maximum(e5, e7), tl.minimum(e5, e7)
    e0, e4 = tl.maximum(e0, e4), tl.minimum(e0, e4)
    e1, e5 = tl.maximum(e1, e5), tl.minimum(e1, e5)
    e2, e6 = tl.maximum(e2, e6), tl.minimum(e2, e6)
    e3, e7 = tl.maximum(e3, e7), tl.minimum(e3, e7)
    e0, e1 = tl.maximum(e0, e1), tl.minimum(e0, e1)
    e2, e3 = tl.maximum(e2, e3), tl.minimum(e2, e3)
    e4, e5 = tl.maximum(e4, e5), tl.minimum(e4, e5)
    e6, e7 = tl.maximum(e6, e7), tl.minimum(e6, e7)
    e2, e4 = tl.maximum(e2, e4), tl.minimum(e2, e4)
    e3, e5 = tl.maximum(e3, e5), tl.minimum(e3, e5)
    e1, e4 = tl.maximum(e1, e4), tl.minimum(e1, e4)
    e3, e6 = tl.maximum(e3, e6), tl.minimum(e3, e6)
    e1, e2 = tl.maximum(e1, e2), tl.minimum(e1, e2)
    e3, e4 = tl.maximum(e3, e4), tl.minimum(e3, e4)
    e5, e6 = tl.maximum(e5, e6), tl.minimum(e5, e6)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def add8(t0, t1, t2, t3, t4, t5, t6, t7, e0, e1, e2, e3, e4, e5, e6, e7, FIRST: tl.constexpr):
    """The 8 largest of the lists and 8 new values (sorted, then merged: ~9 min/max per value, not 15)."""
    e0, e1, e2, e3, e4, e5, e6, e7 = _sort8(e0, e1, e2, e3, e4, e5, e6, e7)
    if FIRST:  # the lists are still empty
        t0, t1, t2, t3, t4, t5, t6, t7 = e0, e1, e2, e3, e4, e5, e6, e7
    else:
        t0, t1, t2, t3, t4, t5, t6, t7 = merge8(t0, t1, t2, t3, t4, t5, t6, t7, e0, e1, e2, e3, e4, e5, e6, e7)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def ins_chunks(t0, t1, t2, t3, t4, t5, t6, t7, v, C: tl.constexpr, FIRST: tl.constexpr):
    """Insert the ``C`` (1, 2, 4 or 8) values along the last axis of ``v [S, M, C]`` into lists ``[S, M]``.

    The last axis is a thread's contiguous load vector, so the splits move no data. ``FIRST``: the lists
    are empty (all -1).
    """
    if C == 1:
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, tl.reshape(v, (v.shape[0], v.shape[1])))
    elif C == 2:
        e0, e1 = tl.split(v)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e0)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e1)
    elif C == 4:
        w0, w1 = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))
        e0, e1 = tl.split(w0)
        e2, e3 = tl.split(w1)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e0)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e1)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e2)
        t0, t1, t2, t3, t4, t5, t6, t7 = ins(t0, t1, t2, t3, t4, t5, t6, t7, e3)
    else:
        w0, w1 = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2, 2)))
        w00, w01 = tl.split(w0)
        w10, w11 = tl.split(w1)
        e0, e1 = tl.split(w00)
        e2, e3 = tl.split(w01)
        e4, e5 = tl.split(w10)
        e6, e7 = tl.split(w11)
        t0, t1, t2, t3, t4, t5, t6, t7 = add8(t0, t1, t2, t3, t4, t5, t6, t7, e0, e1, e2, e3, e4, e5, e6, e7, FIRST)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def resolve(t0, t1, t2, t3, t4, t5, t6, t7, c, cut, kr, done, thr):
    """One round's verdict per group. ``t*``: the 8 largest ``|x|`` below ``cut``; ``c``: count of values in
    ``[cut, previous cut)``; ``kr``: rank from the top still to go before this round. Returns kr, done, thr.
    """
    fin = (done == 0) & (c >= kr)  # the kr-th largest is among the c values >= cut: equal to cut
    thr = tl.where(fin, cut, thr)
    done = tl.where(fin, 1, done)
    kr = tl.where(done == 0, kr - c, kr)
    fin = (done == 0) & (kr <= 8)
    j = kr - 1
    pick = tl.where(j == 0, t0, tl.where(j == 1, t1, tl.where(j == 2, t2, tl.where(j == 3, t3, tl.where(
        j == 4, t4, tl.where(j == 5, t5, tl.where(j == 6, t6, t7)))))))
    thr = tl.where(fin, pick, thr)
    done = tl.where(fin, 1, done)
    return kr, done, thr



@triton.jit
def prep(x, cut, bound, mn, mx, cnt, FIRST: tl.constexpr):
    """``|x|`` masked to ``< cut`` (FIRST: all) and the running min/max of x (FIRST) or the count in [cut, bound)."""
    a = tl.abs(x)
    if FIRST:
        mn = tl.minimum(mn, x)
        mx = tl.maximum(mx, x)
    else:
        cnt += ((a >= cut) & (a < bound)).to(tl.int32)
        a = tl.where(a < cut, a, -1.0)
    return a, mn, mx, cnt


__all__ = ["add8", "ins", "ins_chunks", "merge8", "prep", "resolve"]
