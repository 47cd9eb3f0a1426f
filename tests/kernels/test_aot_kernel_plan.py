"""What a launch plan is (kernels/aot/kernel_plan.py): ``KernelPlan`` evaluating its int32 arguments and its grid from
the rules, on a serving plan of launch_plan.py."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from oscar_export.kernels.aot import launch_plan as lp  # noqa: E402
from oscar_export.kernels.aot.spec import KernelSpec  # noqa: E402
from oscar_export.kernels.layout import KVCacheLayout  # noqa: E402

LAYOUT = KVCacheLayout.default(3, 64)
HEADS = 9


def test_rules_evaluate_on_ints_and_reject_bad_rules():
    cx = lp.decode_split_constexprs(LAYOUT, HEADS, 0.125)
    a = lp.DECODE_SPLIT.scalars({"max_pages": 10, "pages_per_split": 4}, cx)
    # BF16 splits: cdiv(S0 64, 64) + cdiv(C, 64) with C = the recent ring's W + 2P = 384 slots
    assert a == {"max_pages": 10, "pages_per_split": 4, "n_page_splits": 3, "n_splits": 3 + 1 + 6}
    assert lp.DECODE_SPLIT.grid_for({"B": 2, **a}, cx) == (6, 10, 1)
    with pytest.raises(ValueError, match="needs a value for .pages_per_split."):
        lp.DECODE_SPLIT.scalars({"max_pages": 10}, cx)
    with pytest.raises(ValueError, match="are not plan"):
        KernelSpec.from_plan(lp.DECODE_MERGE, "m", {"D": 64})
