"""Hostile sizes and floods on an actor's socket: a frame past ``runtime.max_message_size``
is refused by ZeroMQ before it is buffered (the sender is disconnected, the actor's peak
memory does not move, it keeps serving), and a flood of garbage headers costs the log a
line or two, not one per message."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.messages import Call, Frame
from omniflow.transport.codec import encode
from tests.security.live import ROLE, TOKEN, LiveDeployment, Probe, tensor_config

LIMIT = 16 << 20
BIG = (64 << 20) + 4096  # a float32 tensor's frame, four times the limit


@pytest.fixture(scope="module")
def bounded(run_root_module: Path) -> Iterator[LiveDeployment]:
    name = f"mb{os.getpid() % 10000}"
    dep = LiveDeployment(tensor_config(name, max_message_size="16MiB"))
    try:
        yield dep
    finally:
        dep.close()


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for {pid}")


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text(errors="replace").splitlines() if "malformed" in x]


def _probe(dep: LiveDeployment) -> Probe:
    return Probe(dep.replica.endpoint, str(dep.rt.supervisor.run_dir))


def test_an_oversized_frame_is_dropped_before_it_is_read(bounded):
    pid = bounded.replica.proc.pid
    probe = _probe(bounded)
    try:
        assert probe.served()
        peak = _status(pid, "VmHWM")
        rid = probe.request_id()
        refs = {"x": Frame(1, "float32", (BIG // 4,))}
        call = Call(rid, ROLE, probe.reply_to, tensors=refs, token=TOKEN)
        call.credit = 1
        probe.send([encode(call), bytes(BIG)])
        assert probe.reply_for(rid, timeout=3.0) is None  # never read, so never answered
        assert bounded.alive()
        growth = _status(pid, "VmHWM") - peak
        assert growth < LIMIT, f"peak RSS grew {growth >> 20} MiB for a refused {BIG >> 20} MiB"
    finally:
        probe.close()
    again = _probe(bounded)  # the actor serves on, the refused sender's next socket too
    try:
        assert again.served()
    finally:
        again.close()


def test_a_flood_of_garbage_costs_the_log_a_line_or_two(bounded):
    log_path = Path(bounded.rt.supervisor.run_dir) / "logs" / f"{ROLE}-0.log"
    before = _lines(log_path)
    probe = _probe(bounded)
    try:
        for n in range(1000):
            probe.send([b"\xc1garbage-%d" % n])
        deadline = time.monotonic() + 20
        answered = 0
        while answered < 1000 and time.monotonic() < deadline:  # each is refused by name
            msg = probe.reply(timeout=2.0)
            assert msg is not None and msg.code == "bad_request", msg
            answered += 1
        assert answered == 1000
        assert probe.served()
    finally:
        probe.close()
    lines = _lines(log_path)[len(before) :]
    assert 1 <= len(lines) <= 2, lines
