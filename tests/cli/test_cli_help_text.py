"""Every option's help text reaches the --help page whole.

Typer renders help through rich, whose markup takes "[...]" for a style tag and drops it:
"Output path [default: FILE.zlmz]" printed as "Output path ." Bracketed text in a help
string must be escaped ("\\[default: ...]"); this test renders every command's help page,
recipes included, and looks for each bracketed part of each option's help there.
"""

from __future__ import annotations

import re

import click
from typer.main import get_command
from typer.testing import CliRunner

from zlm.cli import app

_BRACKETED = re.compile(r"\\?\[[^\]]*\]")


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def _squash(text: str) -> str:
    """The page's words in order, without rich's box drawing and line wrapping."""
    return re.sub(r"\s+", "", re.sub(r"[│╭╮╰╯─]", " ", text))


def test_bracketed_help_text_is_printed_not_eaten():
    runner = CliRunner()
    checked, missing = [], []
    for path, cmd in _commands(get_command(app)):
        parts = [(p.name, m.group().removeprefix("\\")) for p in cmd.params
                 for m in _BRACKETED.finditer(getattr(p, "help", None) or "")]
        if not parts:
            continue
        res = runner.invoke(app, [*path, "--help"], terminal_width=100)
        assert res.exit_code == 0, res.output
        page = _squash(res.output)
        for name, part in parts:
            checked.append(part)
            if _squash(part) not in page:
                missing.append(f"zlm {' '.join(path)} --{name}: {part!r}")
    assert not missing, "missing from --help (escape the bracket): " + "; ".join(missing)
    assert len(checked) >= 4  # compress --out and --streams, decompress --out, export --format
