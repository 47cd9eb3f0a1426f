"""``oscar-export``: one small module per subcommand, registered here.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and a module docstring whose
first line is the help text; this file only wires them into argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

#: subcommand -> the module implementing it (a module that fails to import is an error, never a missing command).
COMMANDS: dict[str, str] = {
    "generate": "oscar_export.generate",
    "calibrate": "oscar_export.calibrate",
    "inspect": "oscar_export.inspect_artifact",
    "eval": "oscar_export.eval.driver",
    "export": "oscar_export.export",
    "build": "oscar_export.build",
    "bench": "oscar_export.bench",
}


class UserError(ValueError):
    """A mistake in the command line or its inputs: printed as one line, exit code 2."""


#: What a user can cause (bad input, a full disk, a missing permission, a size that does not fit, Ctrl-C or
#: SIGTERM): one line and exit code 2. TypeError, AttributeError and the like mean a bug here: they keep
#: their traceback. ``--debug`` shows the traceback of these too.
USER_ERRORS = (UserError, ValueError, OSError, RuntimeError, ImportError, MemoryError, KeyboardInterrupt)


def check_int(value: int, option: str, lo: int, hi: int, multiple_of: int = 1) -> int:
    """``value`` if it is an int in ``[lo, hi]`` (and a multiple of ``multiple_of``), else :class:`UserError`."""
    if type(value) is not int or not lo <= value <= hi or value % multiple_of:
        what = f"a multiple of {multiple_of} in" if multiple_of > 1 else "an int in"
        raise UserError(f"{option}: expected {what} [{lo}, {hi}], got {value!r}")
    return value


def check_device(spec: str | int, option: str) -> str:
    """``spec`` (``cpu``, ``cuda``, ``cuda:N`` or a GPU index) if that device exists here, else :class:`UserError`
    (before a model loads: torch's own error would be an ``AssertionError`` after it)."""
    import re

    import torch

    text = f"cuda:{spec}" if type(spec) is int else str(spec)
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", text)
    if m is None:
        raise UserError(f"{option}: expected 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if text.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"{option} {text}: no CUDA device is available here (torch {torch.__version__}, CUDA build "
                            f"{torch.version.cuda or 'none'}); use the CPU or a GPU machine")
        if m[1] is not None and int(m[1]) >= n:
            raise UserError(f"{option} {text}: this machine has {n} CUDA device{'s' if n > 1 else ''} (0..{n - 1})")
    return text


def check_argv(argv: list[str]) -> None:
    """Refuse arguments that are not valid UTF-8 (Python keeps such bytes as surrogates, which nothing can
    write to a file, a tokenizer or a JSON document)."""
    for i, a in enumerate(argv):
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            import os

            shown = os.fsencode(a).decode("utf-8", "backslashreplace")  # the bytes as given: caf\xe9
            raise UserError(f"argument {i + 1} ({shown}): not valid UTF-8; pass text and paths as UTF-8") from None


def is_user_error(e: BaseException) -> bool:
    """:data:`USER_ERRORS`, and the errors of libraries reading what the user gave: a safetensors file that
    cannot be read or written (a full disk, a size limit, a damaged file), a chat template that fails or that
    the sandbox refuses (jinja2)."""
    if isinstance(e, USER_ERRORS):
        return True
    kind = type(e)
    return (kind.__name__ == "SafetensorError" and kind.__module__.startswith("safetensors")) or any(
        c.__module__.startswith("jinja2") and c.__name__ == "TemplateError" for c in kind.__mro__)


def _os_error_text(text: str) -> str:
    """An OS error inside a library's message (safetensors: ``Os { code: 28, ... }``) said as the OS says it."""
    import errno
    import os
    import re

    m = re.search(r"Os \{ code: (\d+)|\(os error (\d+)\)", text)
    if m is None:
        return text
    code = int(m[1] or m[2])
    return f"{os.strerror(code)} [Errno {code} {errno.errorcode.get(code, '?')}] ({text.split(':')[0].strip()})"


def error_line(e: BaseException) -> str:
    """One terminal-safe line describing ``e`` (whitespace collapsed, control characters escaped)."""
    try:
        from oscar_export.calibration.safe_json import printable
    except ImportError:  # the error may be that the project itself cannot import (torch missing)
        def printable(s: str, limit: int) -> str:
            return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s[:limit])

    if isinstance(e, KeyboardInterrupt):
        text = str(e) or "interrupted"
    elif isinstance(e, MemoryError):
        text = f"out of memory (MemoryError){': ' + str(e) if str(e) else ''}"
    elif type(e).__name__ == "SafetensorError":
        text = _os_error_text(str(e))
    elif type(e).__module__.startswith("jinja2"):
        text = f"the chat template failed ({type(e).__name__}): {e}"
    else:
        text = str(e) or type(e).__name__
    return printable(" ".join(text.split()), limit=2000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oscar-export",
        description="OSCAR 2-bit KV cache: calibrate, export, build, evaluate and benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"oscar-export {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or name).strip()
        p = sub.add_parser(
            name,
            help=doc.splitlines()[0],
            description=doc,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .out_dir import release

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        check_argv(argv)
    except UserError as e:
        print(f"oscar-export: error: {error_line(e)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 1
    try:
        return int(args._run(args) or 0)
    except Exception as e:  # noqa: BLE001 -- sorted by is_user_error: a bug keeps its traceback
        if args.debug or not is_user_error(e):
            raise
        print(f"oscar-export {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(f"oscar-export {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2
    finally:
        release()  # the --out claims of this run (their lock files)


if __name__ == "__main__":
    sys.exit(main())
