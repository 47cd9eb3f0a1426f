"""The Triton writers of 4-bit key codes in the mma16 page order (kernels/mma16.py's ``store_mma16`` and
``repack_linear_to_mma16``, as the quantizer and the decode step call them).

The reference defines the order (``reference.pack_mma16(..., bits=4)``: test_reference.py); the Triton writers
(prefill pages, the in-kernel rotation path, the decode step's demotion) must leave every code and
param ``torch.equal`` to the reference's. On the CPU the writers run through Triton's interpreter
(tests/kernels/conftest.py), on the H200 compiled.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from oscar_export.kernels import reference as ref
from oscar_export.kernels.layout import KVCacheLayout, RowFormat
from oscar_export.kernels.transform import LayerTransform

from helpers import CLIPS, LEVELS, appends_equal_reference, assert_equal, assert_quantizes_like_reference, quant_rows


def _k4_mma16(d: int, gran: str, g: int | None = None, p: int = 64, h: int = 3) -> KVCacheLayout:
    """4-bit mma16 keys, 2-bit mma16 values."""
    g = g or d
    return KVCacheLayout(h, d, RowFormat(d, g, gran, bits=4, packing="mma16"), RowFormat(d, g, packing="mma16"),
                         sink=16, window=64, page_size=p)


# ---- the Triton writers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,g,p,gran", [(64, 64, 64, "token"), (128, 128, 32, "token"), (256, 128, 64, "token"),
                                        (128, 64, 32, "token"), (64, 64, 64, "channel"), (128, 128, 32, "channel"),
                                        pytest.param(256, 128, 32, "channel", marks=pytest.mark.slow)])  # ~25 s
def test_quantize_4bit_mma16_key_pages_bit_exact(qp, device, d, g, p, gran):
    """Prefill pages (the plain quantizer): codes and params equal to the reference's."""
    lay = _k4_mma16(d, gran, g, p)
    want_c, _ = assert_quantizes_like_reference(qp, device, quant_rows(2, 3, p, d), lay, lay.key, CLIPS, LEVELS, "key")
    assert int(ref.unpack_page_codes(want_c, lay.key, "key").max()) > 3, "the pages must use 4-bit codes"


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_fused_rotation_4bit_mma16_is_the_linear_result_reordered(qp, device, gran):
    """The in-kernel rotation path (the AOT ``_rot`` kernel) writes the linear 4-bit result in mma16 order."""
    mma = _k4_mma16(64, gran, p=32)
    lin = replace(mma, key=replace(mma.key, packing="linear"), value=replace(mma.value, packing="linear"))
    h, d = 3, 64
    gen = torch.Generator().manual_seed(3)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0].contiguous().to(device)
    rotation = (rot, (torch.rand(h, d, generator=gen) + 0.5).to(device),
                (torch.randn(h, d, generator=gen) * 0.1).to(device))
    x = (torch.randn(2, h, 32, d, generator=gen) * 2).to(device)
    kw = dict(rotation=rotation, fused_rotation=True)
    cl, pl = qp.quantize_pages(x, lin, lin.key, CLIPS.to(device), LEVELS.to(device), **kw)
    cm, pm = qp.quantize_pages(x, mma, mma.key, CLIPS.to(device), LEVELS.to(device), operand="key", **kw)
    assert_equal("params", pm.cpu(), pl.cpu())
    assert_equal("codes", cm.cpu(), ref.pack_page_codes(ref.unpack_codes(cl.cpu(), d, 4), mma.key, "key"))


@pytest.mark.parametrize("gran", ["token", "channel"])
def test_decode_append_4bit_mma16_keys_matches_reference(ds, device, gran):
    """The decode step's demotion into 4-bit mma16 key pages (2-bit mma16 values): every buffer equal."""
    lay = KVCacheLayout(2, 64, RowFormat(64, 64, gran, bits=4, packing="mma16"), RowFormat(64, 64, packing="mma16"),
                        sink=16, window=32, page_size=32)
    tr = LayerTransform.identity(2, 64, k_clip=0.9, v_clip=0.95)
    # 90 steps > S0 + W + P: a demotion of each slot
    book_r, _ = appends_equal_reference(ds, device, lay, tr, 2, 90, 200, 8, f"4-bit mma16 keys {gran}")
    assert int(book_r.committed.num_pages.min()) >= 1, "the test must demote"
