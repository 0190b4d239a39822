"""Small roles for graph tests; workers import them as tests.graph_roles:NAME."""

from __future__ import annotations

import os
import time

import torch

from omniflow.runtime.actor import Actor


class Encoder(Actor):
    """Turns input ``key`` into ``<key>_embeds`` (a string and a tensor)."""

    async def handle(self, request, ctx):
        key = self.options["key"]
        value = request.get(key)
        return {f"{key}_embeds": f"E({value})", f"{key}_vec": torch.full((2,), float(self.replica))}


class Joiner(Actor):
    """Reports what reached it; asks for an image when the request wants one."""

    async def handle(self, request, ctx):
        out = {
            "keys": sorted(set(request.data) | set(request.tensors)),
            "text": request.data.get("text", ""),
        }
        if "image" in str(request.params.get("want", "")):
            out["image_codes"] = [1, 2, 3]
        return out


class Decoder(Actor):
    async def handle(self, request, ctx):
        return {"decoded": request.data["image_codes"], "from": self.role}


class Counter(Actor):
    """Adds one to ``n`` each visit: for bounded loops."""

    async def handle(self, request, ctx):
        return {"n": int(request.data.get("n", 0)) + 1}


class Tokens(Actor):
    """Streams ``params["n"]`` chunks of text tokens, as an LLM does."""

    async def handle(self, request, ctx):
        for index in range(int(request.params.get("n", 3))):
            yield {"tokens": [index], "text": f"{index} "}


class FailsSetup(Actor):
    async def setup(self):
        raise RuntimeError("no weights here")


class Colocated(Actor):
    """Loads 'weights' slowly in setup, then records when it measured free memory."""

    async def setup(self):
        import asyncio
        import time

        await asyncio.sleep(float(self.options.get("load_s", 0)))
        self._weights = bytearray(int(self.options.get("weights_mb", 0)) * 2**20)
        self.setup_done = time.time()

    async def reserve(self, budget):
        import time

        self.measured = time.time()
        self.budget = budget

    def meta(self):
        return {
            "setup_done": self.setup_done,
            "measured": self.measured,
            "fraction": self.budget.fraction,
            "budget_bytes": self.budget.bytes,
        }

    async def handle(self, request, ctx):
        return {"ok": True}


class MakeTensor(Actor):
    """Makes a large tensor; in_pool=True writes it straight into the shared page pool."""

    async def handle(self, request, ctx):
        from omniflow.transport.tensors import attached_pool

        n = int(request.data.get("n", 1 << 18))
        seed = int(request.data.get("seed", 0))
        values = torch.Generator().manual_seed(seed)
        if request.data.get("in_pool"):
            out = attached_pool().empty((n,), torch.float32)
            out.tensor.copy_(torch.rand(n, generator=values))
            ctx.hold(out.lease)  # released once the output has been shared onward
            return {"x": out.tensor, "seed": seed, "n": n}
        return {"x": torch.rand(n, generator=values), "seed": seed, "n": n}


class BurstTensors(Actor):
    """Streams a pool tensor, is deaf for ``block_s`` (a Cancel waits), then streams ``n``
    more in one go: those reach a client that left after the first as late messages."""

    async def handle(self, request, ctx):
        from omniflow.transport.tensors import attached_pool

        def chunk(i):
            out = attached_pool().empty((1 << 14,), torch.float32)
            out.tensor.fill_(i)
            ctx.hold(out.lease)  # released once the output has been shared onward
            return {"x": out.tensor, "i": i}

        yield chunk(0)
        time.sleep(float(request.data.get("block_s", 0.5)))
        for i in range(int(request.data.get("n", 4))):
            yield chunk(i + 1)


class CheckTensor(Actor):
    """Reports what arrived: a checksum, and whether it is a view into the page pool."""

    async def handle(self, request, ctx):
        from omniflow.transport.tensors import attached_pool

        x = request.tensors["x"]
        pool = attached_pool()
        ptr = x.data_ptr()
        in_pool = pool is not None and pool.base <= ptr < pool.base + pool.size
        return {"sum": float(x.double().sum()), "in_pool": in_pool, "n": int(x.numel())}


class AsksPeer(Actor):
    """Names the pid its output will reach, before sending it (as a KV lender does)."""

    async def handle(self, request, ctx):
        return {"peer_pid": ctx.peer_pid(self.options["to"])}


class SaysPid(Actor):
    async def handle(self, request, ctx):
        return {"peer_pid": request.data["peer_pid"], "pid": os.getpid()}


class SumsInParallel(Actor):
    """Sums a tensor large enough that torch runs it in an OpenMP parallel region (which
    starts the OpenMP runtime in this process); answers the sum and its pid."""

    async def handle(self, request, ctx):
        torch.set_num_threads(2)
        total = torch.ones(1 << 22).sum().item()
        return {"sum": total, "pid": os.getpid()}


class WhereIsTensor(Actor):
    """Passes everything on, appending to ``offsets`` where its input ``tensor`` lies in
    the page pool (-1: not in it)."""

    async def handle(self, request, ctx):
        from omniflow.transport.tensors import attached_pool

        t = request.tensors["tensor"]
        pool = attached_pool()
        where = t.data_ptr() - pool.base if pool is not None and pool.contains(t) else -1
        data = {**request.data, "offsets": [*request.data["offsets"], where]}
        return {**data, **request.tensors}
