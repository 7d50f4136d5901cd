"""Every option of every verb says what it does, and every help page renders (a stray ``%`` in a help
text only fails when that page is printed)."""

import argparse

from steptune.cli import build_parser


def _parsers(parser, path):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, [*path, name])


def test_every_option_has_help_and_every_page_renders():
    missing, pages = [], 0
    for path, parser in _parsers(build_parser(), ["steptune"]):
        text = parser.format_help()  # raises on a bad %-format
        assert text.startswith("usage: " + " ".join(path)), text[:80]
        pages += 1
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and not action.help:
                missing.append(f"{' '.join(path)} {action.option_strings[-1]}")
    assert pages >= 25, pages  # every area, its verbs, and demo
    assert not missing, "options without help: " + ", ".join(missing)


def test_every_option_with_a_default_shows_it():
    silent, shown = [], 0
    for path, parser in _parsers(build_parser(), ["steptune"]):
        formatter = parser._get_formatter()
        for action in parser._actions:
            default = action.default
            trivial = default is None or isinstance(default, bool) or default in ([], argparse.SUPPRESS)
            if not action.option_strings or trivial:
                continue
            text = formatter._get_help_string(action) % {"default": default}
            shown += 1
            spelled = {str(default), f"{default:g}" if isinstance(default, float) else str(default)}
            if "default" not in text.lower() or not any(v in text for v in spelled):
                silent.append(f"{' '.join(path)} {action.option_strings[-1]}")
    assert shown >= 60, shown
    assert not silent, "options whose help hides the default: " + ", ".join(silent)
