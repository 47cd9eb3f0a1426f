"""``oscar-export``: one small module per subcommand, registered here.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and a module docstring whose
first line is the help text; this file only wires them into argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

#: subcommand -> module implementing it (imported lazily: `--help` stays fast).
COMMANDS: dict[str, str] = {
    "generate": "oscar_export.generate",
    "calibrate": "oscar_export.calibrate",
    "inspect": "oscar_export.inspect_artifact",
    "eval": "oscar_export.eval.driver",
    "export": "oscar_export.export",
    "build": "oscar_export.build",
    "bench": "oscar_export.bench",
}


class UserError(Exception):
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


def error_line(e: BaseException) -> str:
    """One terminal-safe line describing ``e`` (whitespace collapsed, control characters escaped)."""
    try:
        from oscar_export.calibration.artifact import printable
    except ImportError:  # the error may be that the project itself cannot import (torch missing)
        def printable(s: str, limit: int) -> str:
            return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s[:limit])

    if isinstance(e, KeyboardInterrupt):
        text = str(e) or "interrupted"
    elif isinstance(e, MemoryError):
        text = f"out of memory (MemoryError){': ' + str(e) if str(e) else ''}"
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
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # command not built yet
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 1
    try:
        return int(args._run(args) or 0)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"oscar-export {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
