"""`omniflow send --out` is checked before the request is sent."""

from __future__ import annotations

import json

from tests.helpers import cli, expected_echo


def test_send_refuses_an_out_that_is_a_file_before_sending(detached, tmp_path):
    target = tmp_path / "taken"
    target.write_text("mine")
    sent = cli("send", "--run-dir", str(detached), "-t", "hi", "--out", str(target), check=False)
    assert sent.returncode == 2, sent.stderr
    assert "not a directory" in sent.stderr
    assert sent.stdout == ""  # nothing ran: no text streamed
    assert target.read_text() == "mine"


def test_send_creates_a_missing_out_directory(detached, tmp_path):
    target = tmp_path / "a" / "b"
    sent = cli("send", "--run-dir", str(detached), "-t", "hi", "--out", str(target), "--json")
    assert json.loads(sent.stdout)["text"] == "".join(expected_echo("hi"))
    assert target.is_dir()


def test_send_says_when_a_wanted_modality_came_back_empty(tmp_path, capsys):
    """Audio asked for and none made (a LongCat-Next that ends its audio at once) is said,
    an image that came is not; --json leaves it to the JSON's files."""
    from omniflow.cli.outputs import OutputWriter
    from omniflow.cli.send import _say_missing
    from omniflow.runtime.requests import Output

    writer = OutputWriter(tmp_path, "0123456789abcdef", echo=False)
    writer.add(Output("image_decoder", 0, {"image": b"png"}))
    writer.finish()
    assert writer.made == {"image"} and len(writer.files) == 1
    _say_missing("text,image,audio", writer, as_json=False)
    said = capsys.readouterr().err
    assert "no audio came back" in said and "no image" not in said
    _say_missing(["audio"], writer, as_json=True)
    assert capsys.readouterr().err == ""
