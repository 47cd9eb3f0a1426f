"""``kernels/checks.py``: each check refuses what it says, with the input's name, what was expected and what came.

The wrappers' own bad-input tests (``test_decode_portable.py::test_bad_inputs_raise``,
``test_decode_step.py::test_decode_append_bad_inputs``, ``test_quant_pack.py``) reach these checks through the
launches; here the checks are called directly, without Triton.
"""

from __future__ import annotations

import pytest
import torch

from oscar_export.kernels import checks
from oscar_export.kernels.layout import KVCacheLayout, PagedKV, RowFormat


def _mma(h_kv: int, d: int, gran: str, codebook: bool = False, **kw) -> KVCacheLayout:
    return KVCacheLayout(h_kv, d, RowFormat(d, d, gran, codebook=codebook, packing="mma16"),
                         RowFormat(d, d, codebook=codebook, packing="mma16"), **kw)


def test_check_tensor_names_what_was_expected_and_what_came():
    t = torch.zeros(2, 3)
    checks.check_tensor("x", t, (2, 3), (torch.float32, torch.float16), t.device, contiguous=True)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        checks.check_tensor("x", [0.0], (1,), torch.float32, t.device)
    with pytest.raises(ValueError, match=r"x: expected shape \[3, 2\], got \[2, 3\]"):
        checks.check_tensor("x", t, (3, 2), torch.float32, t.device)
    with pytest.raises(ValueError, match="x: expected dtype torch.int32, got torch.float32"):
        checks.check_tensor("x", t, (2, 3), torch.int32, t.device)
    with pytest.raises(ValueError, match="x: expected device meta, got cpu"):
        checks.check_tensor("x", t, (2, 3), torch.float32, torch.device("meta"))
    checks.check_tensor("x", t.T, (3, 2), torch.float32, t.device)  # contiguity only when asked
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        checks.check_tensor("x", t.T, (3, 2), torch.float32, t.device, contiguous=True)


def test_check_format_refusals():
    checks.check_format(RowFormat(128, 64, bits=4), 128, "w")
    with pytest.raises(NotImplementedError, match="w: the Triton kernels need power-of-two .* got 96, 96, 64"):
        checks.check_format(RowFormat(96, 96), 64, "w")
    with pytest.raises(NotImplementedError, match="w: head_dim and page_size <= 256 supported, got 128, 512"):
        checks.check_format(RowFormat(128, 128), 512, "w")
    with pytest.raises(NotImplementedError, match="w: the Triton kernels write 'mma16' pages for head_dim >= 64"):
        checks.check_format(RowFormat(32, 32, packing="mma16"), 64, "w")


def test_unknown_code_width_raises():
    """A row format with a code width the kernels do not write (only reachable past RowFormat's own check)."""
    from dataclasses import replace

    lay = KVCacheLayout(3, 64, RowFormat(64, 64, "token"), RowFormat(64, 64), sink=64, window=256, page_size=64)
    fmt = replace(lay.key)
    object.__setattr__(fmt, "bits", 8)
    with pytest.raises(NotImplementedError, match="2- and 4-bit codes, got 8-bit"):
        checks.check_format(fmt, 64, "quantize_pages")


def test_check_portable_layout_refusals():
    checks.check_portable_layout(KVCacheLayout.default(2, 128).with_key_bits(4))
    with pytest.raises(ValueError, match="reads 'linear' pages"):
        checks.check_portable_layout(KVCacheLayout.default(2, 128, packing="mma16"))
    with pytest.raises(NotImplementedError, match="head_dim 64, 128 or 256 supported, got 32"):
        checks.check_portable_layout(KVCacheLayout.default(2, 32))


def test_check_paged_state_names_the_buffer():
    lay = KVCacheLayout.default(2, 64)
    st = PagedKV.allocate(lay, 2, 4, 3)
    checks.check_paged_state(st, lay, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"state.sink_k: expected shape \[3, 2, 64, 64\], got \[2, 2, 64, 64\]"):
        checks.check_paged_state(st, lay, 3, torch.device("cpu"))
    from dataclasses import replace

    with pytest.raises(ValueError, match="state.recent_len: expected a contiguous tensor"):
        checks.check_paged_state(replace(st, recent_len=torch.zeros(4, dtype=torch.int32)[::2]), lay, 2,
                                 torch.device("cpu"))


def test_check_hopper_layout_refusals():
    """What the kernel does not read is refused when the cache is made (``checks.check_hopper_layout``); 4-bit keys,
    token or channel, are read."""
    from dataclasses import replace

    with pytest.raises(NotImplementedError, match="codebook"):
        checks.check_hopper_layout(_mma(2, 128, "token", codebook=True), 8)
    with pytest.raises(NotImplementedError, match="head_dim"):
        checks.check_hopper_layout(_mma(2, 96, "token"), 8)
    with pytest.raises(NotImplementedError, match="page_size"):
        checks.check_hopper_layout(_mma(2, 128, "token", page_size=32), 8)
    with pytest.raises(NotImplementedError, match="GQA ratios"):
        checks.check_hopper_layout(_mma(1, 128, "token"), 32)
    checks.check_hopper_layout(_mma(8, 128, "token"), 32)
    checks.check_hopper_layout(_mma(8, 128, "channel").with_key_bits(4), 32)
    with pytest.raises(NotImplementedError, match="token groups of head_dim or, at head_dim 256, of 128, got 64"):
        checks.check_hopper_layout(KVCacheLayout(2, 128, RowFormat(128, 64, packing="mma16"),
                                                 RowFormat(128, 64, packing="mma16")), 8)
    checks.check_hopper_layout(_mma(2, 128, "token").with_key_bits(4), 8)
    lay = _mma(2, 128, "token")
    with pytest.raises(NotImplementedError, match="2-bit value"):
        checks.check_hopper_layout(replace(lay, value=replace(lay.value, bits=4)), 8)
    with pytest.raises(ValueError, match="reads 'mma16' pages"):
        checks.check_hopper_layout(lay.with_packing("linear"), 8)


def test_wrapper_refuses_misaligned_page_buffers():
    """A contiguous but sliced pool (base address off a 16-byte boundary) is refused before any launch."""
    from dataclasses import replace

    st = PagedKV.allocate(_mma(2, 128, "token"), 1, 2, 2)
    shape = st.k_codes.shape
    sliced = torch.zeros(st.k_codes.numel() + 16, dtype=torch.uint8)[4:4 + st.k_codes.numel()].view(shape)
    assert sliced.is_contiguous() and sliced.data_ptr() % 16 == 4
    with pytest.raises(ValueError, match="state.k_codes: .* starts 4 bytes past a boundary"):
        checks.check_hopper_state(replace(st, k_codes=sliced))


def test_hopper_device_check(monkeypatch):
    """The Gluon kernel runs on Hopper only: the CPU and other GPUs get one clear error (no compile failure)."""
    with pytest.raises(NotImplementedError, match="CUDA only"):
        checks.check_hopper_device(torch.device("cpu"))
    for cap, ok in (((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        if ok:
            checks.check_hopper_device(torch.device("cuda"))
        else:
            with pytest.raises(NotImplementedError, match=f"Hopper GPU \\(sm_90\\), this one is sm_{cap[0]}{cap[1]}"):
                checks.check_hopper_device(torch.device("cuda"))
