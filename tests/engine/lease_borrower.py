"""A borrower process for the KV lease tests: attaches the pool, reads leased KV on command."""

from __future__ import annotations

import os
from typing import Any

import torch

from omniflow.kv.share import KVLeaseView
from omniflow.memory import PagePool


def serve(pool_name: str, conn: Any) -> None:
    torch.set_num_threads(1)
    pool = PagePool.attach(pool_name)
    views: dict[int, KVLeaseView] = {}
    conn.send(os.getpid())
    while True:
        command, key, arg = conn.recv()
        if command == "open":
            try:
                views[key] = KVLeaseView(pool, arg)
            except Exception as e:  # a revoked lease: the parent checks the message
                conn.send(f"{type(e).__name__}: {e}")
                continue
            conn.send(views[key].lease.num_tokens)
        elif command == "read":  # every layer's keys and values, copied out for the parent
            view = views[key]
            conn.send([tuple(t.clone() for t in view.layer(i)) for i in range(view.num_layers)])
        elif command == "close":
            views.pop(key).close()
            conn.send(None)
        else:
            conn.send(None)
            return
