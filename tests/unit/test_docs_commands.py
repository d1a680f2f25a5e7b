"""Every ``kandev`` command the README and the man pages write is one the parser accepts, and
kandev(1) describes every command the parser has (Issue 23 scenario C, Issue 23 item 4).

A command line is taken from the README's code blocks and inline code, and from kandev(1)'s
command headings, then made concrete the way a reader would: optional parts kept, the first of
``a|b`` alternatives chosen, placeholders (``TASK``, ``SESSION``, ``N``...) given a value; then
``build_parser().parse_args`` must accept it."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from daemon.cli import parser as cli_parser

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAN = REPO / "packaging/man/kandev.1"
NUMBERS = {"N", "S", "C", "SECONDS"}  # placeholders of numbers


def _concrete(line: str) -> list[str]:
    """The argv (after ``kandev``) a reader types for the documented ``line``."""
    words = shlex.split(line.replace("[", " ").replace("]", " "))
    argv: list[str] = []
    skip = False
    for word in words[1:]:
        if skip:
            skip = False
            continue
        if word == "|":  # "--wait | --follow": the first alternative
            skip = True
            continue
        if word in ("...", "]...") or word.startswith("#"):
            continue
        word = word.split("|")[0]
        if word in NUMBERS:
            word = "5"
        elif re.fullmatch(r"[A-Z][A-Z_]*(=[A-Z_]+)?", word):
            word = "x=y" if "=" in word else "abcd1234"
        argv.append(word)
    return argv


def _parses(argv: list[str]) -> str | None:
    """None when the parser accepts ``argv``, else why not."""
    try:
        cli_parser.build_parser().parse_args(argv)
    except SystemExit as exc:
        return None if exc.code == 0 else f"exit {exc.code}"
    return None


def _names(argv: list[str]) -> str | None:
    """None when ``argv`` names a command of the parser and only options that command (or kandev
    itself) has; else what is wrong. For mentions in running text (``kandev resume``) and the man
    page's headings, which show a command's options rather than one call."""
    parser = cli_parser.build_parser(complete=True)
    top = {o for a in parser._actions for o in a.option_strings}
    words = list(argv)
    while words and words[0] in top:
        words.pop(0)
        if words and not words[0].startswith("-"):
            words.pop(0)  # --home DIR
    here, path = parser, []
    while words:
        subs = [a for a in here._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0].startswith("-"):
            break
        if words[0] not in subs[0].choices:
            return f"no command {' '.join(path + words[:1])!r}"
        path.append(words[0])
        here = subs[0].choices[words.pop(0)]
    if not path:
        return "no command" if not set(argv) & {"--version", "--help"} else None
    known = top | {o for a in here._actions for o in a.option_strings}
    unknown = [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in known]
    return f"{' '.join(path)}: no option {unknown}" if unknown else None


def readme_commands(text: str) -> tuple[list[str], list[str]]:
    """``kandev ...`` lines of the README's indented code blocks (calls: they must parse), and the
    ``kandev ...`` of its inline code (mentions: they must name a command and its options)."""
    calls = []
    for line in text.splitlines():
        if line.startswith("    "):
            code = re.sub(r"\s#.*$", "", line.strip())
            calls += [part.strip() for part in code.split("&&") if part.strip().startswith("kandev ")]
    mentions = re.findall(r"`(kandev [^`]+)`", text)
    pipe = re.compile(r"\s\|\s+(?=[a-z])")  # "kandev board | head -3": kandev's part (not "--wait | --follow")
    return [pipe.split(c)[0] for c in calls], [pipe.split(m)[0] for m in mentions]


def _troff(text: str) -> str:
    text = re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\(dq", '"')
    return text


def man_headings(text: str) -> list[str]:
    """The command of each ``.TP`` heading of kandev(1)'s COMMANDS section."""
    commands = text.split(".SH COMMANDS", 1)[1].split("\n.SH ", 1)[0]
    lines = commands.splitlines()
    out = []
    for before, line in zip(lines, lines[1:], strict=False):
        if before == ".TP" and line.startswith((".B ", ".BI ", ".BR ")):
            macro, _, rest = line.partition(" ")
            parts = shlex.split(rest) if macro != ".B" else [rest]
            out.append(_troff("".join(parts)))
    return out


def _leaves(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix.strip()]
    out = []
    for name, sub in subs[0].choices.items():
        out += _leaves(sub, f"{prefix} {name}")
    return out


def test_every_kandev_command_in_the_readme_parses() -> None:
    calls, mentions = readme_commands(README.read_text())
    assert len(calls) > 30 and len(mentions) > 20, (calls, mentions)  # the extraction finds them
    bad = [(c, why) for c in calls if (why := _parses(_concrete(c)))]
    bad += [(m, why) for m in mentions if (why := _names(_concrete(m)))]
    assert not bad, bad


def test_every_kandev_command_heading_of_the_man_page_parses() -> None:
    headings = man_headings(MAN.read_text())
    assert len(headings) > 15, headings
    bad = []
    for heading in headings:
        for one in heading.split(", "):  # "up, down"
            if why := _names(_concrete("kandev " + one)):
                bad.append((one, why))
    assert not bad, bad


def test_the_man_page_describes_every_command_of_the_parser() -> None:
    headings = " | ".join(man_headings(MAN.read_text()))
    missing = [leaf for leaf in _leaves(cli_parser.build_parser(complete=True)) if not re.search(rf"(^|[ |,]){re.escape(leaf)}\b", headings)]
    assert not missing, f"kandev(1) has no .TP heading for: {missing}"
    assert "KANDEV_CONFIG" in MAN.read_text() and "KANDEV_HOME" in MAN.read_text()


@pytest.mark.parametrize("line", ["kandev sesion list", "kandev task create --titel x", "kandev task"])
def test_the_checks_fail_on_a_command_the_parser_refuses(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _parses(_concrete(line)) is not None
    if line != "kandev task":
        assert _names(_concrete(line)) is not None


def _parsers(parser: argparse.ArgumentParser, name: str = "kandev") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += _parsers(sub, f"{name} {sub_name}")
    return out


def test_every_option_of_every_command_is_described_in_its_help() -> None:
    """Issue 23 item 4: ``--help`` describes every option and argument, of every command."""
    undescribed = []
    for name, parser in _parsers(cli_parser.build_parser(complete=True)):
        if not parser.description:
            undescribed.append(f"{name} (no description)")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                undescribed.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not undescribed, undescribed
