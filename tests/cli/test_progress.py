"""The step counter `omniflow send` shows while an image is denoised."""

import io

from rich.console import Console

from omniflow.cli.progress import StepCounter


def steps_written(terminal: bool) -> str:
    out = io.StringIO()
    counter = StepCounter(Console(file=out, force_terminal=terminal))
    for step in (1, 2, 3):
        counter.update({"step": step, "steps": 3})
    counter.update({"text": "not progress"})
    counter.done()
    return out.getvalue()


def test_a_terminal_sees_one_line_rewritten_in_place():
    assert steps_written(terminal=True) == (
        "\rdenoising step 1/3\rdenoising step 2/3\rdenoising step 3/3\n"
    )


def test_a_log_or_pipe_gets_a_line_per_step():
    assert steps_written(terminal=False) == (
        "denoising step 1/3\ndenoising step 2/3\ndenoising step 3/3\n"
    )
