"""The HTTP connection phase of benchmarks/fuzz.py: idle, slow and oversized connections
against a live gateway, each judged by what the gateway answers (a clear 4xx, or a 503
with its reason) and by the gateway's fds and peak memory."""

from __future__ import annotations

import selectors
import socket
import time
from pathlib import Path
from typing import Any


def _status_of(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _answers(socks: list[socket.socket], wait_s: float) -> list[bytes]:
    """What each socket got before the gateway closed it (or ``wait_s`` passed)."""
    got = {s.fileno(): b"" for s in socks}
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    end = time.monotonic() + wait_s
    while sel.get_map() and (left := end - time.monotonic()) > 0:
        for key, _ in sel.select(min(left, 0.5)):
            sock: Any = key.fileobj
            try:
                chunk = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if chunk:
                got[key.fd] += chunk
            else:
                sel.unregister(sock)
    sel.close()
    out = [got[s.fileno()] for s in socks]
    for s in socks:
        s.close()
    return out


def _code(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _clear(data: bytes, expected: set[int]) -> bool:
    """An expected status with an error body naming the reason."""
    return _code(data) in expected and b'"message"' in data


def connection_phase(host: str, port: int, key: str, pid: int, wait_s: float) -> dict[str, Any]:
    """Idle, slow and oversized connections; figures and the unclear answers."""
    unclear: list[str] = []
    fds_before, peak_before = _fds(pid), _status_of(pid, "VmHWM")

    def connect() -> socket.socket:
        return socket.create_connection((host, port), timeout=5)

    idle = [connect() for _ in range(300)]
    time.sleep(0.5)
    fds_during = _fds(pid)
    got = _answers(idle, wait_s)
    idle_codes = [_code(a) for a in got]
    unclear += [f"idle: {a[:80]!r}" for a in got if not _clear(a, {408, 503})]

    slow = [connect() for _ in range(20)]
    for i, s in enumerate(slow):
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: loc")  # a head that never ends
        else:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: "
                b"Bearer " + key.encode() + b"\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4096\r\n\r\n{"
            )  # a body that never ends
    got = _answers(slow, wait_s)
    unclear += [f"slow: {a[:80]!r}" for a in got if not _clear(a, {408, 503})]

    big = [connect() for _ in range(10)]
    line = b"a" * 65536
    for s in big:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        try:
            for _ in range(64):  # 4 MiB of one header line, unless it hangs up first
                s.sendall(line)
        except OSError:
            pass
    got = _answers(big, wait_s)
    unclear += [f"oversized: {a[:80]!r}" for a in got if not _clear(a, {431})]
    time.sleep(0.5)
    return {
        "idle_connections": len(idle),
        "idle_answers": {str(c): idle_codes.count(c) for c in sorted(set(idle_codes))},
        "gateway_fds": {"before": fds_before, "during_idle": fds_during, "after": _fds(pid)},
        "gateway_peak_rss_growth_mb": round((_status_of(pid, "VmHWM") - peak_before) / 2**20, 1),
        "unclear": unclear,
    }
