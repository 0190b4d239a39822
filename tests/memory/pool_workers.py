"""Targets for worker processes in the pool tests (spawned: a real separate process each).

A worker attaches the pool by name and serves commands from its end of a Pipe; every
reply is ``("ok", value)`` or ``("err", "ExceptionType: message")``.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from typing import Any

import torch

from omniflow.memory import PagePool

SPAWN = mp.get_context("spawn")


def digest(t: torch.Tensor) -> str:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(raw).hexdigest()


def serve(name: str, conn: Any) -> None:
    torch.set_num_threads(1)  # several workers on two cores: no spinning OpenMP pools
    pool = PagePool.attach(name)
    views: dict[int, torch.Tensor] = {}
    held = []
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "open":
                view = views[arg.lease] = pool.open(arg)
                reply: Any = (digest(view), pool.contains(view))
            elif cmd == "release":
                reply = pool.release(arg)
            elif cmd == "alloc":
                start = time.perf_counter()
                try:
                    lease = pool.alloc(arg)
                finally:
                    elapsed = time.perf_counter() - start
                held.append(lease)
                reply = (lease.id, elapsed)
            elif cmd == "fill":  # a block this worker allocates, fills and shares with pid arg
                t, lease = pool.empty((1000,), torch.float32)
                t.copy_(torch.arange(1000, dtype=torch.float32))
                reply = pool.share(t, arg)
                lease.release()
            elif cmd == "stress":  # alloc, stamp, check, free: overlapping blocks would show
                reply = _stress(pool, *arg)
            elif cmd == "exit":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except Exception as e:  # noqa: BLE001 - the test reads the message
            conn.send(("err", f"{type(e).__name__}: {e}"))


def _stress(pool: PagePool, rounds: int, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    stamp = os.getpid() % 251
    done = 0
    for _ in range(rounds):
        pages = int(torch.randint(1, 6, (), generator=gen))
        try:
            lease = pool.alloc(pages * pool.page_size)
        except MemoryError:
            continue
        block = pool.block_bytes(lease.id)
        block.fill_(stamp)
        time.sleep(0)
        if not bool((block == stamp).all()):
            raise AssertionError(f"block of lease {lease.id} was written by another process")
        lease.release()
        done += 1
    return done


def create_and_hold(name: str, conn: Any) -> None:
    """A stand-in supervisor: creates the pool, allocates, then waits to be killed."""
    pool = PagePool.create(name, 4 << 20, page_size=64 << 10)
    lease = pool.alloc(1 << 20)
    conn.send(("ready", (os.getpid(), lease.id)))
    conn.recv()


class Worker:
    """A spawned ``serve`` process and the parent's end of its pipe."""

    def __init__(self, name: str) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=serve, args=(name, child), daemon=True)
        self.proc.start()
        child.close()
        self.pid = -1

    def ready(self, timeout: float = 60.0) -> Worker:
        if not self.conn.poll(timeout):
            raise TimeoutError("worker did not start")
        tag, self.pid = self.conn.recv()
        assert tag == "ready"
        return self

    def call(self, cmd: str, arg: Any = None, timeout: float = 30.0) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {cmd!r} within {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                self.proc.kill()
        self.proc.join(10)


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:  # ask all first: their exits overlap
        if w.proc.is_alive():
            w.conn.send(("exit", None))
    for w in workers:
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(10)


def start_workers(name: str, n: int) -> list[Worker]:
    workers = [Worker(name) for _ in range(n)]  # start all, then wait: imports overlap
    return [w.ready() for w in workers]
