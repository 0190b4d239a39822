"""One actor replica's process: ``python -m omniflow.runtime.worker RUN_DIR ROLE REPLICA``.

Startup is a handshake with the supervisor: HELLO as soon as the process runs,
then ``setup()`` (weights, warm-up), then bind, register, READY. Shutdown
(SIGTERM, a Shutdown message, or the supervisor's death) deregisters first,
drains in-flight requests with a timeout, then closes in reverse order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import zmq

from omniflow.control.balance import make_policy
from omniflow.control.discovery import Registry, actor_key, encode_record, open_registry
from omniflow.control.discovery.view import RegistryView
from omniflow.control.routing import Router
from omniflow.memory import PagePool
from omniflow.messages import LEAVING, ActorRecord, Hello, Ready, SetupFailed, Shutdown
from omniflow.runtime import logs
from omniflow.runtime.actor import Actor
from omniflow.runtime.config import Config, from_json
from omniflow.runtime.control_link import ControlLink
from omniflow.runtime.gpus import attach_device_pools, uses_gpu
from omniflow.runtime.holding import HoldingFile, holding_path
from omniflow.runtime.host import ActorHost
from omniflow.runtime.kv_peers import KVPeers
from omniflow.runtime.loading import load_actor_class
from omniflow.runtime.resources import budget_after_barrier
from omniflow.runtime.rundir import check_private, run_root_of
from omniflow.runtime.tracing import Tracer
from omniflow.transport.codec import BadMessage, decode, decoder_for, encode
from omniflow.transport.endpoint import Inbox, Outbox
from omniflow.transport.links import attach_pool

log = logging.getLogger("omniflow.runtime.worker")
# DEALERs a worker keeps open (next-hop replicas and the clients it answers); one FD
# each: clients that connect per request then cost a replica at most this many FDs.
WORKER_PEERS = 64
_control_decoder = decoder_for(Shutdown)


def endpoint_for(config: Config, run_dir: Path, role: str, replica: int) -> str:
    if config.runtime.transport == "tcp":
        return f"tcp://{config.addresses()[0]}:*"
    return f"ipc://{run_dir}/{role}-{replica}.sock"


# The kernel's word that the supervisor died: a signal of its own, because at that moment
# getppid() may still name the dead parent (the reparenting comes after the signal).
PARENT_DIED = signal.SIGUSR2


def die_with_parent() -> None:
    """Ask the kernel for ``PARENT_DIED`` when the supervisor dies (Linux); until the
    worker's loop handles it, its default action ends the process at once."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, PARENT_DIED)  # PR_SET_PDEATHSIG


ORPHAN_DRAIN_S = 1.0  # in-flight work an orphaned worker still finishes


class Worker:
    def __init__(self, run_dir: Path, role: str, replica: int) -> None:
        self.run_dir = run_dir
        self.role = role
        self.replica = replica
        # A run dir another user may write is not ours to trust (its deployment.json).
        check_private(run_dir, run_root_of(run_dir))
        self.config = from_json((run_dir / "deployment.json").read_bytes())
        self.role_config = self.config.processes()[role]
        self.ctx = zmq.Context()
        self.stop = asyncio.Event()
        self.host: ActorHost | None = None
        self.intake_closed = False
        self.devices: list[str] = []  # PCI bus ids of the GPUs it computes on
        self.parent = os.getppid()  # the supervisor; another parent later means it died
        self.parent_died = False

    async def run(self, control_address: str, registry_address: str) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self._close_intake)  # the supervisor stops
        loop.add_signal_handler(PARENT_DIED, self._on_parent_died)
        control = ControlLink(self.ctx, control_address, self._on_control)
        control.start()
        pid = os.getpid()
        control.send(encode(Hello(self.role, self.replica, pid)))
        gpu = uses_gpu(self.role_config.options)  # only then: pinning and a CUDA context
        pin = gpu and self.config.cache.pin_memory
        pool = PagePool.attach(
            os.environ["OMNIFLOW_POOL"], populate=self.config.cache.populate, pin=pin
        )
        attach_pool(pool, self.config.cache.frame_threshold_bytes)
        self.devices = (
            attach_device_pools(pool, self.config.cache, self.role_config.options) if gpu else []
        )
        registry = open_registry(registry_address)
        began = time.monotonic()
        try:
            cls = load_actor_class(self.role_config.actor)
            actor = cls(self.role, self.replica, self.role_config.options)
            use_pool = getattr(actor, "use_pool", None)
            if use_pool is not None:  # roles that keep data in the pool (encoder caches)
                use_pool(pool, self.config.cache)
            await actor.setup()
            budget = await budget_after_barrier(
                self.config,
                registry,
                self.role,
                self.replica,
                os.environ.get("OMNIFLOW_GENERATION", "0"),
            )
            if budget is not None:
                await actor.reserve(budget)
            loaded = actor.describe()
        except Exception as e:
            await registry.close()
            traceback.print_exc()
            message = f"{type(e).__name__}: {e}"
            control.send(encode(SetupFailed(self.role, self.replica, pid, message)))
            control.close()
            return 3
        # Weights, modules and torch are loaded now and live as long as the process:
        # freeze them out of the collector, or every full collection walks them all
        # (tens of milliseconds with torch imported) under the requests in flight.
        gc.collect()
        gc.freeze()
        took = round(time.monotonic() - began, 2)
        described = logs.fields(pid=pid, setup_s=took, code=self.role_config.actor, **loaded)
        log.info("%s/%d loaded", self.role, self.replica, extra=described)
        try:
            return await self._serve(actor, control, registry)
        finally:
            control.close(0 if self.orphaned else None)  # nobody reads it once orphaned
            self.ctx.term()

    async def _serve(self, actor: Actor, control: ControlLink, registry: Registry) -> int:
        cfg, rt = self.config, self.config.runtime
        view = RegistryView(registry, cfg.name)
        await view.start()
        policies = {name: make_policy(rc.policy, role=name) for name, rc in cfg.roles.items()}
        idempotent = frozenset(n for n, rc in cfg.roles.items() if rc.idempotent)
        keys = cfg.security.load_keys()
        outbox = Outbox(self.ctx, cfg.runtime.send_timeout_s, max_peers=WORKER_PEERS, keys=keys)
        router = Router(cfg.plan(), view, outbox, policies, idempotent, cfg.host_id)
        rc = self.role_config
        holding = HoldingFile(
            holding_path(self.run_dir, self.role, self.replica),
            rc.max_concurrency + rc.max_queue,  # it grows: joins' waiting ones count too
        )
        host = ActorHost(
            actor, router, rc.max_concurrency, rc.max_queue, holding, rc.max_stream_chunks
        )
        host.tracer = Tracer(cfg.tracing, cfg.name, self.role, self.replica)
        self.host = host
        if self.intake_closed:
            host.close_intake()
        inbox = Inbox(
            self.ctx,
            endpoint_for(cfg, self.run_dir, self.role, self.replica),
            host.on_message,
            keys=keys,
            hwm=rt.inbox_hwm,
            advertise=cfg.addresses()[1],
            max_message=rt.max_message_bytes,
        )
        host.reply = inbox.reply
        inbox.start()
        kv_peers = await self._kv_peers(actor, view, keys)
        record = ActorRecord(
            self.role,
            self.replica,
            os.getpid(),
            inbox.endpoint,
            cfg.host_id,
            list(self.role_config.gpus),
            "ready",
            started=time.time(),
            meta=actor.meta(),
            devices=self.devices,
        )
        key = actor_key(cfg.name, self.role, self.replica)
        await registry.put(key, encode_record(record), ttl=rt.ttl_s)
        control.send(encode(Ready(self.role, self.replica, os.getpid(), inbox.endpoint)))
        beat = asyncio.create_task(self._heartbeat(registry, key, record, host, actor))
        try:
            await self.stop.wait()
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            orphaned = self.orphaned  # no registry calls then: the TTL drops the record
            await self._leave_and_drain(registry, key, record, host, orphaned)
            inbox.close()
            with contextlib.suppress(Exception):
                await actor.close()
            if kv_peers is not None:
                await kv_peers.close()
            await view.close()
            if orphaned:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(registry.close(), 0.2)
            else:
                await registry.close()
            # The last hops of drained requests still leave (briefly, for an orphan).
            outbox.close(linger_ms=200 if orphaned else 1000)
            host.tracer.close()  # the spans of drained requests still go out
            holding.close()
        return 0

    async def _kv_peers(self, actor: Actor, view: RegistryView, keys: Any) -> KVPeers | None:
        """Serve and pull prefix KV pages, for the roles that do (the llm role)."""
        if not actor.uses_kv_peers:
            return None
        cfg = self.config
        kv_peers = KVPeers(
            self.ctx,
            endpoint_for(cfg, self.run_dir, f"{self.role}-kv", self.replica),
            keys,
            view,
            self.role,
            self.replica,
            cfg.host_id,
            advertise=cfg.addresses()[1],
        )
        await actor.use_kv_peers(kv_peers)
        return kv_peers

    async def _leave_and_drain(
        self, registry: Registry, key: str, record: ActorRecord, host: ActorHost, orphaned: bool
    ) -> None:
        """Producers stop picking this replica; in an ordered stop (intake closed) it stays
        listed while it drains, so new requests get a quick shutting_down. An orphan drains
        briefly and leaves the registry alone."""
        rt = self.config.runtime
        listed = self.intake_closed
        if not listed and not orphaned:
            await self._leaving(registry, key, record)
        # The lease outlives the drain: a record that expired while this replica still
        # held a request would read, to the clients, as a replica gone with it.
        lease = None if orphaned else asyncio.create_task(self._keep_lease(registry))
        try:
            drained = await host.drain(
                min(rt.drain_timeout_s, ORPHAN_DRAIN_S) if orphaned else rt.drain_timeout_s
            )
        finally:
            if lease is not None:
                lease.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lease
        if listed and not orphaned:
            await self._leaving(registry, key, record)
        if not orphaned:
            with contextlib.suppress(Exception):
                await registry.delete(key)
        if not drained:
            log.warning("%s/%d: in-flight requests cancelled at shutdown", self.role, self.replica)

    async def _keep_lease(self, registry: Registry) -> None:
        while True:
            await asyncio.sleep(self.config.runtime.heartbeat_s)
            try:
                await registry.keepalive()
            except Exception as e:  # as in the heartbeat: the TTL is the judge
                log.warning("%s/%d: keepalive failed: %s", self.role, self.replica, e)

    @property
    def orphaned(self) -> bool:
        """The supervisor died (kill -9): this worker then exits within ~2 s, not after
        waiting out registry calls to a registry that may have died with it."""
        return self.parent_died or os.getppid() != self.parent

    def _on_parent_died(self) -> None:
        self.parent_died = True
        self.stop.set()

    async def _leaving(self, registry: Registry, key: str, record: ActorRecord) -> None:
        """Leave routing in order: a record that is no longer ready and holds nothing, so
        that no client takes this leaving for a loss (a replica gone with its host ends
        what it was working on; one leaving drains it first)."""
        record.state, record.holding = LEAVING, []
        with contextlib.suppress(Exception):
            await registry.put(key, encode_record(record), ttl=self.config.runtime.ttl_s)

    async def _heartbeat(
        self, registry, key: str, record: ActorRecord, host: ActorHost, actor: Actor
    ) -> None:
        """Keep the lease alive; re-put the record when its load, the actor's meta or its
        stats changed.

        ``meta()`` is what producers route on beyond load (an LLM's summary of the
        sessions and media it holds): a change goes out at the next beat. ``figures()``
        (engine figures) ride the same record to the gateway's /metrics: no socket or
        scrape of its own, and a replica gone from the registry is gone from /metrics.
        An idle replica's figures stay put, so it still only sends keepalives.
        """
        rt = self.config.runtime
        published = (0, 0)
        while True:
            await asyncio.sleep(rt.heartbeat_s)
            if self.orphaned:  # before PDEATHSIG took hold, or reparented to a subreaper
                self.stop.set()
                return
            try:
                now = (host.inflight, host.served)
                meta = actor.meta()
                stats = {"queue_depth": float(host.queued), **actor.figures()}
                if now != published or meta != record.meta or stats != record.stats:
                    record.inflight, record.served = now
                    record.holding = host.holding()
                    record.meta, record.stats = meta, stats
                    await registry.put(key, encode_record(record), ttl=rt.ttl_s)
                    published = now
                else:
                    await registry.keepalive()
            except Exception as e:  # the registry may be briefly away; the TTL is the judge
                log.warning("%s/%d: heartbeat failed: %s", self.role, self.replica, e)

    def _close_intake(self) -> None:
        self.intake_closed = True
        if self.host is not None:
            self.host.close_intake()

    def _on_control(self, header: bytes) -> None:
        try:
            if isinstance(decode(header, _control_decoder), Shutdown):
                self.stop.set()
        except BadMessage:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omniflow.runtime.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("role")
    parser.add_argument("replica", type=int)
    args = parser.parse_args(argv)
    die_with_parent()
    logs.configure(f"{args.role}/{args.replica}")
    import uvloop

    worker = Worker(args.run_dir, args.role, args.replica)
    control = os.environ["OMNIFLOW_CONTROL"]
    profile = os.environ.get("OMNIFLOW_PROFILE")  # a folder: write a cProfile of this worker
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return uvloop.run(worker.run(control, os.environ["OMNIFLOW_REGISTRY"]))
        finally:
            profiler.disable()
            profiler.dump_stats(f"{profile}/{args.role}-{args.replica}-{os.getpid()}.prof")
    return uvloop.run(worker.run(control, os.environ["OMNIFLOW_REGISTRY"]))


if __name__ == "__main__":
    sys.exit(main())
