"""``kernels/cache_keys.py``: one Triton cache key per kernel in every process, whatever kernel launches first.

With Triton 3.6 (the H200's) a kernel's source hash took in only the helpers hashed before it, so the decode-step
append kernel got one key in the precompile workers (launched first there) and another in a serving process (the
prefill's quantizer launched first): the compiled step recompiled the kernels the workers had written. Reproduce
the order dependence on the CPU with a Triton 3.6.0 virtualenv: on the old code the two orders below gave the append
kernel keys 236d33c8... and 003b82dc...; Triton 3.9 (CI's) hashes alike in either order, so there the first test is
what can fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

REACHABLE = textwrap.dedent("""
    import sys
    from importlib import import_module
    from oscar_export.kernels.cache_keys import _callees

    module = import_module("oscar_export.kernels." + sys.argv[1])
    seen, todo = set(), [getattr(module, name) for name in sys.argv[2:]]
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        assert fn.hash is not None and not fn.hash.startswith("recursion"), (fn.__name__, fn.hash)
        todo += _callees(fn)
    print(len(seen), "hashed on import")
""")

EVERY = textwrap.dedent("""
    import sys
    from importlib import import_module
    from triton.runtime.jit import JITFunction

    module = import_module("oscar_export.kernels." + sys.argv[1])
    fns = [v for v in vars(module).values() if isinstance(v, JITFunction) and v.__module__ == module.__name__]
    unhashed = [fn.__name__ for fn in fns if fn.hash is None or fn.hash.startswith("recursion")]
    assert not unhashed, unhashed
    print(len(fns), "hashed on import")
""")

ORDER = textwrap.dedent("""
    import sys
    from oscar_export.kernels import decode_step, quant_pack
    first = quant_pack._quant_pack_kernel if sys.argv[1] == "quant" else decode_step._decode_append_kernel
    first.cache_key
    print(decode_step._decode_append_kernel.cache_key)
""")


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_every_helper_of_the_step_kernels_is_hashed_on_import():
    """Failed before: nothing was hashed until a kernel's first launch, in that launch's order."""
    assert int(_run(REACHABLE, "decode_step", "_decode_append_kernel").split()[0]) > 10
    assert int(_run(REACHABLE, "quant_pack", "_quant_pack_kernel").split()[0]) > 5


def test_every_helper_of_the_portable_decode_kernels_is_hashed_on_import():
    """The split kernel and its page helpers (``decode/portable_pages.py``, ``window_block`` shared with the hopper
    kernel): failed before portable.py hashed its kernels on import."""
    assert int(_run(REACHABLE, "decode.portable", "decode_split_kernel").split()[0]) > 10


def test_every_jit_function_of_the_helper_modules_is_hashed_on_import():
    """The helper modules split out of quant_pack.py, decode/portable.py and decode/portable_pages.py hash their JIT
    functions on their own import, each after the helpers it calls, as the kernel modules do."""
    for module, count in (("quant_codes", 4), ("quant_token", 2), ("quant_channel", 4), ("decode.portable_grouped", 7),
                          ("decode.portable_rows", 1), ("decode.splits", 1)):
        assert int(_run(EVERY, module).split()[0]) == count, module


def test_the_append_kernel_has_one_key_whatever_launches_first():
    assert _run(ORDER, "quant") == _run(ORDER, "append")
