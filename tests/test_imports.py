"""The package's import structure: its floors, no import cycle between its modules, no Triton behind the HF host.

The modules are found where the installed package keeps them (``src/oscar_export/``), read with ``ast`` and never
imported, so an upward import or a cycle shows whatever the order of import.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from oscar_export.cli import COMMANDS

#: the floors of docs/design.md §2, lowest first: a module imports only from its own floor or those below it.
#: ``checkpoint`` (the exported checkpoint's schema: the artifact inside a HF checkpoint) stands on the artifact's
#: floor; every other module of ``oscar_export`` is a command or what the commands share.
FLOORS = (
    ("kernels", ("oscar_export.kernels",)),
    ("calibration", ("oscar_export.calibration", "oscar_export.checkpoint")),
    ("plugins", ("oscar_export.plugins",)),
    ("commands", ("oscar_export",)),
)
#: what ``plugins`` may read of the calibration floor: the artifact type, the model-family table beside its
#: fingerprint, and the checkpoint that carries the artifact
ARTIFACT_TYPE = ("oscar_export.calibration.artifact", "oscar_export.calibration.families", "oscar_export.checkpoint")


def _modules(folder: Path | None = None) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` file of the package (a package is its ``__init__.py``);
    ``folder``: a copy of the package's folder to read instead of the installed one."""
    if folder is None:
        (where,) = importlib.util.find_spec("oscar_export").submodule_search_locations
        folder = Path(where)
    mods = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(["oscar_export", *parts])] = path
    return mods


def _graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> the package modules it imports -> the line of the first such import."""
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _imports(name: str, path: Path, mods: dict[str, Path]) -> dict[str, int]:
    """The package modules ``name`` imports anywhere in its file (module level or inside a function: a lazy import
    closes a cycle as surely as an eager one) -> the line of the first such import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods:  # `import a.b.c` (or a name inside a.b.c): the module a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected set of modules that has one (Tarjan), as module paths."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # walk inside the group from its first module until a module repeats
        path = [min(group)]
        while path.count(path[-1]) < 2:
            path.append(min(w for w in graph[path[-1]] if w in group))
        cycles.append(path[path.index(path[-1]):])
    return cycles


def _floor(module: str) -> int:
    """The index in :data:`FLOORS` of the floor ``module`` stands on (the longest matching prefix wins)."""
    matches = [(len(p), i) for i, (_, prefixes) in enumerate(FLOORS) for p in prefixes
               if module == p or module.startswith(p + ".")]
    return max(matches)[1]


def _floor_breaches(graph: dict[str, dict[str, int]], commands: set[str]) -> list[str]:
    """One line for each import that breaks the floors: upward, into a command module, or from ``plugins`` into the
    calibration floor beyond :data:`ARTIFACT_TYPE`."""
    out = []
    for a in sorted(graph):
        for b, line in sorted(graph[a].items()):
            fa, fb = _floor(a), _floor(b)
            where = f"{a}, line {line}: imports {b}"
            if fb > fa:
                out.append(f"{where} (floor {FLOORS[fb][0]} above {FLOORS[fa][0]})")
            elif b in commands:
                out.append(f"{where} (a command module: nothing imports one)")
            elif FLOORS[fa][0] == "plugins" and FLOORS[fb][0] == "calibration" and b not in ARTIFACT_TYPE:
                out.append(f"{where} (plugins read only the artifact type of the calibration floor)")
    return out


def test_the_floor_check_names_each_kind_of_breach():
    """On a made-up graph: an upward import, an import of a command, and plugins reaching past the artifact type
    are each named; the imports the floors allow are not."""
    graph = {
        "oscar_export.kernels.layout": {"oscar_export.plugins.hf.cache": 3},  # upward
        "oscar_export.calibration.artifact": {"oscar_export.kernels.layout": 1},
        "oscar_export.calibration.pipeline": {"oscar_export.calibration.artifact": 1},
        "oscar_export.checkpoint": {"oscar_export.calibration.artifact": 1},
        "oscar_export.plugins.hf.cache": {"oscar_export.calibration.artifact": 1, "oscar_export.checkpoint": 2,
                                          "oscar_export.calibration.pipeline": 5},  # past the artifact type
        "oscar_export.build": {"oscar_export.export": 7, "oscar_export.checkpoint": 8},  # a command
        "oscar_export.export": {"oscar_export.plugins.hf.cache": 1},
    }
    assert _floor_breaches(graph, {"oscar_export.export", "oscar_export.build"}) == [
        "oscar_export.build, line 7: imports oscar_export.export (a command module: nothing imports one)",
        "oscar_export.kernels.layout, line 3: imports oscar_export.plugins.hf.cache (floor plugins above kernels)",
        "oscar_export.plugins.hf.cache, line 5: imports oscar_export.calibration.pipeline (plugins read only the "
        "artifact type of the calibration floor)",
    ]


def test_the_floors_hold():
    """``kernels`` <- ``calibration`` <- ``plugins`` <- the commands, and no module imports a command module."""
    breaches = _floor_breaches(_graph(_modules()), set(COMMANDS.values()))
    assert not breaches, "imports against the floors (docs/design.md §2):\n" + "\n".join(breaches)


def test_a_planted_upward_import_is_caught(tmp_path):
    """The package copied, one lazy import of ``plugins`` planted inside ``kernels/layout.py``: the floor check of
    the copy names it (and only it)."""
    (where,) = importlib.util.find_spec("oscar_export").submodule_search_locations
    copy = tmp_path / "oscar_export"
    shutil.copytree(where, copy, ignore=shutil.ignore_patterns("__pycache__"))
    layout = copy / "kernels" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef planted():\n    from oscar_export.plugins.hf import cache\n")
    breaches = _floor_breaches(_graph(_modules(copy)), set(COMMANDS.values()))
    assert len(breaches) == 1 and breaches[0].startswith("oscar_export.kernels.layout, line "), breaches
    assert "imports oscar_export.plugins.hf.cache (floor plugins above kernels)" in breaches[0], breaches


def test_the_walk_sees_the_package():
    """The walk finds the mapped folders' modules and their imports (else the no-cycle test below proves nothing)."""
    mods = _modules()
    for name in ("oscar_export.cli", "oscar_export.kernels.reference", "oscar_export.kernels.decode.backend",
                 "oscar_export.plugins.hf", "oscar_export.plugins.hf.cache", "oscar_export.calibration.families"):
        assert name in mods, sorted(mods)
    hf = _imports("oscar_export.plugins.hf", mods["oscar_export.plugins.hf"], mods)
    assert "oscar_export.plugins.hf.cache" in hf, hf
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle():
    """No two modules import each other, directly or around a loop, even lazily inside a function."""
    graph = _graph(_modules())
    cycles = _cycles(graph)
    lines = [" -> ".join(c) + "\n" + "".join(f"    {a}, line {graph[a][b]}: imports {b}\n" for a, b in zip(c, c[1:]))
             for c in cycles]
    assert not cycles, "import cycles:\n" + "".join(lines)


def _private_imports(mods: dict[str, Path]) -> list[str]:
    """One line for each ``from <package module> import _name`` in a module other than ``_name``'s own (an alias
    ``import x as _y`` imports the public ``x`` and is not one): a name shared across modules is a public name of the
    module that owns it."""
    out = []
    for name, path in sorted(mods.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base not in mods and not base.startswith("oscar_export."):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private and base != name:
                out.append(f"{name}, line {node.lineno}: from {base} import {', '.join(private)}")
    return out


def test_the_private_import_check_names_each_one(tmp_path):
    """On made-up modules: a private name imported from another module is named (eagerly or inside a function); a
    public name, an alias to a private name and an import from outside the package are not."""
    (tmp_path / "a.py").write_text("_x = 1\ny = 2\n")
    (tmp_path / "b.py").write_text("from .a import y as _y\nfrom os import _exit\nfrom .a import _x, y\n\n\n"
                                   "def f():\n    from oscar_export.kernels.a import _x\n")
    mods = {"oscar_export.kernels.a": tmp_path / "a.py", "oscar_export.kernels.b": tmp_path / "b.py"}
    assert _private_imports(mods) == ["oscar_export.kernels.b, line 3: from oscar_export.kernels.a import _x",
                                      "oscar_export.kernels.b, line 7: from oscar_export.kernels.a import _x"]


def test_no_private_name_crosses_a_module():
    """No module of the package imports another module's ``_private`` name."""
    found = _private_imports(_modules())
    assert not found, f"{len(found)} imports of private names across modules:\n" + "\n".join(found)


_TRITON_WATCH = textwrap.dedent("""
    import importlib.abc, sys
    from pathlib import Path

    repo = Path(sys.argv[1]).resolve()
    importers = []

    class Watch(importlib.abc.MetaPathFinder):
        # blocks Triton so that it never enters sys.modules (a third party may probe for it, e.g. torch.compile
        # at import), and notes the importing line when it is one of this repository's
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                frame = sys._getframe(1)
                while frame.f_code.co_filename.startswith("<frozen"):  # the import machinery
                    frame = frame.f_back
                f = Path(frame.f_code.co_filename)
                if f.is_absolute() and f.resolve().is_relative_to(repo):
                    importers.append(f"{f}:{frame.f_lineno}")
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
            return None

    sys.meta_path.insert(0, Watch())
    import oscar_export.kernels.reference  # noqa: F401
    import oscar_export.plugins.hf  # noqa: F401
    import oscar_export.plugins.hf.ops  # noqa: F401
    import oscar_export.plugins.hf.triton_backend  # noqa: F401
    print("importers:", importers)
""")


def test_importing_the_hf_host_asks_for_no_triton():
    """Triton is an optional extra: importing the PyTorch reference (``oscar_export.kernels.reference``, every
    submodule) and ``oscar_export.plugins.hf`` (its reference backend and the Triton backend's module) asks for no
    Triton, not even in a guarded ``try: import triton`` (in a child process, with Triton blocked; the kernels it
    launches import it when a Triton op is first called)."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _TRITON_WATCH, str(repo)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("importers: []"), proc.stdout[-2000:]
