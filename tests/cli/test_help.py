"""The help a new user reads first: plain sentences, no reStructuredText markup."""

from __future__ import annotations

import pytest

from tests.helpers import cli


@pytest.mark.parametrize("command", ["", "up", "status", "send", "logs", "down"])
def test_help_has_no_raw_backticks(command):
    proc = cli(*filter(None, [command]), "--help")
    assert "`" not in proc.stdout, proc.stdout
    assert "Usage:" in proc.stdout


def test_top_level_help_lists_every_command_and_the_exit_codes():
    text = " ".join(cli("--help").stdout.split())
    for command in ("up", "status", "send", "logs", "down"):
        assert f"│ {command} " in text
    assert "2 a bad config or argument" in text and "3 no such deployment running" in text


def test_send_help_names_the_accepted_media_formats():
    text = " ".join(cli("send", "--help").stdout.replace("│", " ").split())
    assert "PNG, JPEG" in text
    assert "16-bit PCM or 32-bit float" in text
