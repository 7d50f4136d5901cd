"""The ``steptune`` console script. Each area registers its own verbs from its ``cli.py``."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence

import steptune

__all__ = ["build_parser", "main"]

AREAS = ("memory", "comm", "pipeline", "kernels", "resilience")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steptune",
        description="Faster, more resilient large-model training on PyTorch.",
        epilog="Run `steptune demo` for a tour; `steptune AREA --help` for an area's verbs.",
    )
    parser.add_argument("--version", action="version", version=f"steptune {steptune.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for area in AREAS:
        importlib.import_module(f"steptune.{area}.cli").register(sub)
    importlib.import_module("steptune.demo").register(sub)
    _mark_verbs(parser)
    return parser


class _DefaultsFormatter(argparse.HelpFormatter):
    """Ends an option's help with its default, unless the text gives it already or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default in ([], ())
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class _RawDefaultsFormatter(_DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _mark_verbs(parser: argparse.ArgumentParser) -> None:
    """Give each verb's namespace its parser (``args._parser``), so a verb can tell an option the user set
    from its default (``core.argtypes.warn_ignored``); every page shows the options' defaults."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = _RawDefaultsFormatter if raw else _DefaultsFormatter
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        parser.set_defaults(_parser=parser)
    for action in subs:
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, child in action.choices.items():
            if not child.description and helps.get(name):  # `--help` said nothing about what a verb does
                h = str(helps[name])
                child.description = h[0].upper() + h[1:] + ("" if h.endswith(".") else ".")
            _mark_verbs(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name = " ".join(str(x) for x in (args.command, getattr(args, "verb", None)) if x)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C: pools, process groups and servers leave through their context
        # managers, so no worker or scratch folder outlives the command (exit status 143).
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # user mistakes carry a message that says what to change
        print(f"steptune {name}: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # a path on the command line that is not there
        what = f"no such file: {exc.filename}" if exc.filename else str(exc)
        print(f"steptune {name}: error: {what}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that slipped past the parse-time checks; timeouts are not usage errors
        if exc.filename is None or isinstance(exc, (TimeoutError, ConnectionError)):
            raise
        print(f"steptune {name}: error: cannot use {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # child processes are cleaned up by their pools' context managers
        print(f"steptune {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
