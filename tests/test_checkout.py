"""The checkout as a user opens it: nothing at its root shadows an installed package.

``python3 -m pytest``, ``python3 -c``, a REPL and Jupyter put the current directory first on ``sys.path``, so a
folder with ``__init__.py`` (or a ``.py`` file) at the checkout's root wins over an installed package of that name.
A top-level ``kernels/`` did that to Hugging Face's ``kernels``, which transformers imports since 5.25: the sources
therefore live under ``src/`` (docs/design.md §2).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run from the checkout's root, where sys.path[0] is that root, as for a REPL or `python3 -m pytest` there.
_FROM_ROOT = textwrap.dedent("""
    import importlib.metadata, sys
    from pathlib import Path
    root = Path(sys.argv[1])
    assert sys.path[0] in ("", str(root)), sys.path[:2]

    def outside(module):
        return root not in Path(module.__file__).resolve().parents

    from transformers import LlamaForCausalLM  # imports Hugging Face's `kernels` where it is installed

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        try:
            import kernels
        except ImportError:
            pass
        else:
            raise AssertionError(f"`import kernels` found {kernels!r} with no `kernels` distribution installed")
    else:
        import kernels
        assert kernels.__file__ and outside(kernels), kernels
    import oscar_export
    assert oscar_export.__file__.endswith("src/oscar_export/__init__.py") or outside(oscar_export), oscar_export
    print("ok")
""")


def test_the_checkout_root_holds_no_importable_name():
    importable = sorted(p.name for p in ROOT.iterdir()
                        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py")
    assert not importable, f"importable from the checkout's root, shadowing installed packages so named: {importable}"


def test_imports_from_the_checkout_root_find_the_installed_packages():
    proc = subprocess.run([sys.executable, "-c", _FROM_ROOT, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_sources_are_one_package_under_src():
    (folder,) = [p for p in (ROOT / "src").iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")]
    assert folder.name == "oscar_export" and (folder / "__init__.py").is_file()
    assert importlib.metadata.version("oscar-export")
