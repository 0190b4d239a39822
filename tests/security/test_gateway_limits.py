"""The gateway's per-connection bounds, over real sockets: idle connections past
``max_connections`` are refused and the rest time out, an oversized or slow request head
and a slow body get a clear 4xx, too many bodies at once a 503; fds and memory stay
bounded and the gateway serves on."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.roles.gateway.limits import limits_of
from omniflow.runtime.config import GatewayConfig
from tests.security.gateway_live import KEY, LiveGateway

LIMITS = {
    "max_connections": 16,
    "header_timeout_s": 1.0,
    "max_header_kb": 8,
    "body_timeout_s": 1.0,
    "max_body_reads": 3,
    "max_body_mb": 0.5,
    "body_memory_mb": 1.0,
    "keepalive_timeout_s": 1,
    "max_id_chars": 64,
}


@pytest.fixture(scope="module")
def gw(run_root_module: Path) -> Iterator[LiveGateway]:
    dep = LiveGateway(f"gl{os.getpid() % 10000}", **LIMITS)
    try:
        yield dep
    finally:
        dep.close()


def _connect(gw: LiveGateway) -> socket.socket:
    return socket.create_connection((gw.host, gw.port), timeout=5)


def _answer(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """What the gateway wrote before closing (or within ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _post_head(length: int, extra: str = "") -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def test_idle_connections_past_the_cap_are_refused_and_the_rest_time_out(gw):
    pid = gw.replica.proc.pid
    before = _fds(pid)
    socks = [_connect(gw) for _ in range(60)]
    try:
        time.sleep(0.3)
        assert _fds(pid) <= before + LIMITS["max_connections"] + 2
        answers = [_answer(s, timeout=4.0) for s in socks]  # every one closed by the gateway
    finally:
        for s in socks:
            s.close()
    statuses = [_status(a) for a in answers]
    assert statuses.count(503) >= 60 - LIMITS["max_connections"], statuses
    assert set(statuses) <= {503, 408}, statuses
    assert b"connections open" in answers[-1]
    assert gw.chat("after the flood")[0] == 200
    time.sleep(0.2)
    assert _fds(pid) <= before + 8  # the chat's own ZeroMQ peers


def test_an_oversized_request_head_is_a_431_without_memory_growth(gw):
    pid = gw.replica.proc.pid
    peak = int(Path(f"/proc/{pid}/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    sock = _connect(gw)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        line = b"a" * 65536
        try:
            for _ in range(160):  # 10 MiB of one header line, unless it hangs up first
                sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _answer(sock)
    finally:
        sock.close()
    assert _status(data) == 431, data[:200]
    status = Path(f"/proc/{pid}/status").read_text()
    grown = int(status.split("VmHWM:")[1].split()[0]) * 1024 - peak
    assert grown < 8 << 20, f"peak RSS grew {grown >> 20} MiB"
    assert gw.chat()[0] == 200


def test_a_slow_head_and_a_slow_body_are_408s(gw):
    head = _connect(gw)
    body = _connect(gw)
    try:
        head.sendall(b"GET /health HTTP/1.1\r\nHost: local")  # and never the rest
        body.sendall(_post_head(1000) + b'{"model": ')  # 990 bytes short, for ever
        started = time.monotonic()
        slow_head, slow_body = _answer(head), _answer(body)
        took = time.monotonic() - started
    finally:
        head.close()
        body.close()
    assert _status(slow_head) == 408 and _status(slow_body) == 408, (slow_head, slow_body)
    assert b"body took more than" in slow_body
    assert took < 4.0


def test_bodies_past_the_read_limit_get_503_and_the_slots_come_back(gw):
    held = [_connect(gw) for _ in range(LIMITS["max_body_reads"])]
    try:
        for s in held:
            s.sendall(_post_head(1000) + b"{")
        time.sleep(0.3)
        status, body = gw.chat()
        assert status == 503 and "bodies are being read" in body["error"]["message"], body
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)  # their body timeouts
    assert gw.chat()[0] == 200


def test_an_idle_kept_alive_connection_is_closed(gw):
    sock = _connect(gw)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.settimeout(5)
        first = sock.recv(65536)
        assert _status(first) == 200
        started = time.monotonic()
        assert _answer(sock, timeout=5.0) == b""  # closed, not left open
        assert time.monotonic() - started < LIMITS["keepalive_timeout_s"] + 2
    finally:
        sock.close()


def test_a_long_session_or_user_id_is_a_400(gw):
    status, body = gw.chat(session="s" * 65)
    assert (status, body["error"]["param"]) == (400, "session"), body
    status, body = gw.chat(user="u" * 65)
    assert (status, body["error"]["param"]) == (400, "user"), body
    status, body, _ = gw.request(
        "POST",
        "/v1/chat/completions",
        {"model": gw.name, "messages": [{"role": "user", "content": "hi"}]},
        {"X-Session-Id": "h" * 65},
    )
    assert (status, body["error"]["param"]) == (400, "session"), body


def test_connections_stay_below_the_fd_limit():
    limits = limits_of(GatewayConfig(max_connections=5000), fds=1024)
    assert limits.max_connections == 1024 - 256
    assert limits_of(GatewayConfig(), fds=65536).max_connections == 1000


def test_bodies_held_one_byte_short_are_bounded_by_the_memory_budget(gw):
    size = 480 << 10  # under max_body_mb each; two of them and a third pass body_memory_mb
    held = [_connect(gw), _connect(gw)]
    try:
        for s in held:
            s.sendall(_post_head(size) + b"x" * (size - 1))
        time.sleep(0.3)
        third = _connect(gw)
        try:
            third.sendall(_post_head(size) + b"x" * (size - 1))
            data = _answer(third, timeout=3.0)
        finally:
            third.close()
        assert _status(data) == 503 and b"request bodies it may" in data, data[:300]
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)
    assert gw.chat()[0] == 200
