"""Spawns, watches and restarts the actor processes of one deployment.

The supervisor owns the run directory (sockets, state file, logs), the
embedded registry, and one process per replica. It never installs signal
handlers itself: ``omniflow up`` does that for its own process, and an
embedding program keeps its own. Children are watched through pidfds on the
event loop; a child that dies unasked is restarted with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

import omniflow
from omniflow.control.discovery import (
    EmbeddedRegistryServer,
    Registry,
    RegistryError,
    actor_key,
    open_registry,
)
from omniflow.memory import unlink_pool
from omniflow.messages import Hello, Ready, SetupFailed, Shutdown
from omniflow.runtime import preload
from omniflow.runtime.config import Config
from omniflow.runtime.drain import stop_replicas
from omniflow.runtime.gpus import placement_env
from omniflow.runtime.hosts import HostRecord, HostShare, is_multi_host
from omniflow.runtime.replica import Replica, StartError, retrieve
from omniflow.runtime.supervisor_dir import (
    check_run_dir,
    clean_run_dir,
    lock_run_dir,
    run_dir_for,
    write_state,
)
from omniflow.transport.codec import MAX_HEADER_BYTES, BadMessage, decode, decoder_for
from omniflow.transport.endpoint import Inbox, Outbox

if TYPE_CHECKING:
    from omniflow.memory import PagePool

log = logging.getLogger("omniflow.runtime.supervisor")
_control_decoder = decoder_for(Hello | Ready | SetupFailed | Shutdown)
# The replica state each worker message moves to.
_STATE_OF: dict[type, str] = {Hello: "setup", Ready: "ready", SetupFailed: "failed"}


class Supervisor:
    def __init__(
        self,
        config: Config,
        run_dir: Path | None = None,
        on_progress: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir or run_dir_for(config))
        self.on_progress = on_progress or (lambda actor_id, state: None)
        # On several hosts, replica numbers are claimed in etcd at start (see runtime.hosts).
        self.replicas = [
            Replica(role, i)
            for role, rc in config.local_processes().items()
            for i in range(rc.replicas)
        ]
        self.share: HostShare | None = None
        self.ctx = zmq.Context()
        self.outbox = Outbox(self.ctx, send_timeout=1.0)
        self.registry_server: EmbeddedRegistryServer | None = None
        self.registry_address = config.registry
        self.control: Inbox | None = None
        self.stopped = asyncio.Event()
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        self._registry: Registry | None = None
        self.pool: PagePool | None = None
        # Delete a dead replica's registry key at once instead of waiting out its lease.
        self.forget_dead = True
        self.generation = f"{os.getpid()}-{int(time.time() * 1000)}"  # names one start's barriers
        self._lock_fd: int | None = None

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.json"

    # ------------------------------------------------------------------ start

    @property
    def pool_name(self) -> str:
        # Named after the run dir too: two deployments of one name under different run
        # roots must not unlink (or attach to) each other's pool.
        where = hashlib.blake2b(str(self.run_dir.resolve()).encode(), digest_size=4).hexdigest()
        return f"omniflow-{os.getuid()}-{self.config.name}-{where}"

    async def start(self) -> None:
        self._prepare_run_dir()
        try:
            await self._start_under_lock()
        except BaseException:
            await self.stop()
            raise
        self._write_state()

    async def _start_under_lock(self) -> None:
        # One host page pool per deployment, mapped by every local process; a segment
        # left by a supervisor that was killed is replaced, not reused.
        unlink_pool(self.pool_name)
        from omniflow.memory import PagePool  # torch: only a starting deployment pays for it

        self.pool = PagePool.from_config(self.pool_name, self.config.cache, create=True)
        if self.config.registry == "embedded":
            self.registry_server = EmbeddedRegistryServer(
                f"ipc://{self.run_dir}/registry.sock", self.ctx
            )
            await self.registry_server.start()
            self.registry_address = self.registry_server.address
        self._registry = open_registry(self.registry_address)
        if is_multi_host(self.config):
            try:
                await self._join_hosts(self._registry)
            except RegistryError as e:
                raise StartError(f"host {self.config.host_id} could not join: {e}") from None
        self.control = Inbox(  # workers send headers only
            self.ctx,
            f"ipc://{self.run_dir}/control.sock",
            self._on_control,
            max_message=MAX_HEADER_BYTES,
        )
        self.control.start()
        for replica in self.replicas:
            self._spawn(replica)
        await self._wait_ready(self.replicas)

    async def _join_hosts(self, registry: Registry) -> None:
        """This host's share: replica numbers no other host holds, then the host record,
        the shared config, and a watch for `omniflow down --all`."""
        cfg = self.config
        self.share = HostShare(cfg, registry)
        counts: dict[str, int] = {}
        for r in self.replicas:
            counts[r.role] = counts.get(r.role, 0) + 1
        numbers = await self.share.claim_replicas(counts)
        for role, indices in numbers.items():
            for replica, index in zip(
                (r for r in self.replicas if r.role == role), indices, strict=True
            ):
                replica.index = index
        record = HostRecord(
            cfg.host_id,
            sorted(counts),
            cfg.addresses()[1],
            os.getpid(),
            str(self.run_dir),
            time.time(),
        )
        await self.share.announce(record)
        self.share.on_down(self.request_stop)

    def _unlock_run_dir(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with its last descriptor
            self._lock_fd = None

    def _prepare_run_dir(self) -> None:
        self._lock_fd = lock_run_dir(self.run_dir, self.config.name)
        try:
            check_run_dir(self.run_dir, self.config)
        except BaseException:
            self._unlock_run_dir()
            raise

    def _spawn(self, replica: Replica) -> None:
        assert self.control is not None
        env = dict(os.environ)
        package_root = str(Path(omniflow.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        env["OMNIFLOW_CONTROL"] = self.control.endpoint
        env["OMNIFLOW_REGISTRY"] = self.registry_address
        env["OMNIFLOW_GENERATION"] = self.generation
        env["OMNIFLOW_POOL"] = self.pool_name
        env["OMNIFLOW_RUN_DIR"] = str(self.run_dir)  # a role that opens a Client (gateway)
        env = preload.worker_env(env)  # tcmalloc and Intel OpenMP, where installed
        rc = self.config.processes()[replica.role]
        placement_env(env, rc.gpus, rc.replicas, replica.index)  # CUDA_VISIBLE_DEVICES
        log_path = self.run_dir / "logs" / f"{replica.role}-{replica.index}.log"
        with open(log_path, "ab") as log_file:
            replica.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omniflow.runtime.worker",
                    str(self.run_dir),
                    replica.role,
                    str(replica.index),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Their own process group: a terminal's Ctrl-C reaches the supervisor only,
                # which drains them in order (PDEATHSIG still ends them with it).
                process_group=0,
            )
        replica.state = "spawned"
        replica.ready = asyncio.get_running_loop().create_future()
        # A start aborted by another replica's failure never awaits this one's: retrieved
        # here, so no "Future exception was never retrieved" at exit.
        replica.ready.add_done_callback(retrieve)
        replica.exited = asyncio.get_running_loop().create_future()
        replica.pidfd = os.pidfd_open(replica.proc.pid)
        asyncio.get_running_loop().add_reader(replica.pidfd, self._on_exit, replica)
        self._progress(replica.actor_id, "spawned")

    async def _wait_ready(self, replicas: list[Replica]) -> None:
        futures = [r.ready for r in replicas if r.ready is not None]
        timeout = self.config.runtime.start_timeout_s
        done, pending = await asyncio.wait(futures, timeout=timeout)
        for fut in done:
            fut.result()  # raises StartError of a replica whose setup failed
        if pending:
            late = [r.actor_id for r in replicas if r.ready in pending]
            raise StartError(f"not ready within {timeout:g}s: {', '.join(late)}")

    def _on_control(self, identity: bytes, parts: list[Any]) -> None:
        try:
            msg = decode(parts[0], _control_decoder)
        except BadMessage:
            return
        if isinstance(msg, Shutdown):
            self.request_stop(msg.timeout or None)
            return
        replica = self._find(msg.role, msg.replica)
        if replica is None or replica.proc is None or replica.proc.pid != msg.pid:
            return
        if replica.state == _STATE_OF[type(msg)]:
            return  # a repeat: the link sends its latest state again after a drop
        if isinstance(msg, Hello):
            replica.state = "setup"
            self._progress(replica.actor_id, "setup")
        elif isinstance(msg, Ready):
            replica.state = "ready"
            replica.ready_at = time.monotonic()
            replica.endpoint = msg.endpoint
            self._progress(replica.actor_id, "ready")
            if replica.ready is not None and not replica.ready.done():
                replica.ready.set_result(None)
        elif isinstance(msg, SetupFailed):
            replica.state = "failed"
            self._progress(replica.actor_id, "failed")
            err = StartError(f"{replica.actor_id} failed in setup: {msg.message}")
            if replica.ready is not None and not replica.ready.done():
                replica.ready.set_exception(err)

    def _progress(self, actor_id: str, state: str) -> None:
        """Tell ``on_progress``; a callback that raises must not stop a start or a restart."""
        try:
            self.on_progress(actor_id, state)
        except Exception:
            log.exception("the progress callback failed on %s %s", actor_id, state)

    def _find(self, role: str, index: int) -> Replica | None:
        for r in self.replicas:
            if r.role == role and r.index == index:
                return r
        return None

    # ------------------------------------------------------------------ watch

    def _on_exit(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        assert replica.proc is not None and replica.pidfd is not None
        loop.remove_reader(replica.pidfd)
        os.close(replica.pidfd)
        replica.pidfd = None
        # Take back what the dead process held in the pool before its pid can be reused.
        if self.pool is not None:
            self.pool.reclaim({replica.proc.pid})
        replica.fail_what_it_was_holding(self.run_dir, self.outbox)
        code = replica.proc.wait()
        preload.forget(replica.proc.pid)  # Intel OpenMP's registration file, after a kill -9
        if replica.exited is not None and not replica.exited.done():
            replica.exited.set_result(code)
        if replica.ready is not None and not replica.ready.done():
            replica.ready.set_exception(
                StartError(
                    f"{replica.actor_id} exited with code {code} during startup; "
                    f"see {self.run_dir / 'logs' / (replica.role + '-' + str(replica.index) + '.log')}"
                )
            )
        if self._stopping:
            replica.state = "stopped"
            return
        log.warning(
            "%s (pid %d) exited with code %s; restarting", replica.actor_id, replica.proc.pid, code
        )
        replica.state = "restarting"
        replica.restarts += 1
        # A replica that served for as long as the longest wait starts the backoff afresh.
        healthy = replica.ready_at and time.monotonic() - replica.ready_at >= (
            self.config.runtime.restart_backoff_max_s
        )
        replica.backoff_step = 1 if healthy else replica.backoff_step + 1
        replica.ready_at = 0.0
        with contextlib.suppress(OSError):  # `omniflow status` shows it restarting
            self._write_state()
        self._own(self._restart(replica))

    def _own(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, replica: Replica) -> None:
        rt = self.config.runtime
        if self._registry is not None and self.forget_dead:
            key = actor_key(self.config.name, replica.role, replica.index)
            with contextlib.suppress(Exception):
                await self._registry.delete(key)
        step = replica.backoff_step
        delay = min(rt.restart_backoff_s * (2 ** (step - 1)), rt.restart_backoff_max_s)
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self._spawn(replica)
        try:
            await self._wait_ready([replica])
        except StartError as e:
            log.error("restart of %s failed: %s", replica.actor_id, e)
        else:
            self._write_state()

    # ------------------------------------------------------------------ stop

    def request_stop(self, timeout: float | None = None) -> None:
        """Safe from a signal handler: only schedules the stop."""
        if not self._stopping:
            self._own(self.stop(timeout))

    async def wait(self) -> None:
        await self.stopped.wait()

    async def stop(self, timeout: float | None = None) -> None:
        """Stop in pipeline order: no new requests anywhere, then each role in turn from the
        graph's entry, so a request in flight finishes through every role after it. The
        drain takes at most ``timeout`` seconds (default: ``runtime.drain_timeout_s`` + 2);
        what is left then gets SIGTERM and, 2 s later, SIGKILL."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        if self._lock_fd is None:  # never started (or lost the race): nothing here is ours
            self.ctx.term()
            self.stopped.set()
            return
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        await stop_replicas(
            self.replicas,
            self.config.plan(),
            self.config.runtime.drain_timeout_s + 2.0 if timeout is None else timeout,
        )
        for r in self.replicas:
            if r.pidfd is not None:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(r.pidfd)
                os.close(r.pidfd)
                r.pidfd = None
            r.state = "stopped"
        if self.share is not None:
            await self.share.close()
        if self._registry is not None:
            await self._registry.close()  # the host record and the claims go with the lease
        self.outbox.close()
        if self.control is not None:
            self.control.close()
        if self.registry_server is not None:
            await self.registry_server.close()
        self.ctx.term()
        if self.pool is not None:
            self.pool.unlink()
            self.pool.close()
            self.pool = None
        clean_run_dir(self.run_dir)
        self._unlock_run_dir()
        self.stopped.set()

    # ------------------------------------------------------------------ state

    def _write_state(self) -> None:
        state = {
            "name": self.config.name,
            "pid": os.getpid(),
            "run_dir": str(self.run_dir),
            "registry": self.registry_address,
            "control": self.control.endpoint if self.control else "",
            "config": self.config.source,
            "pool": self.pool_name,
            "started": time.time(),
            "host_id": self.config.host_id,
            # What the registry cannot say: a replica restarting has no record there.
            "actors": [
                {
                    "role": r.role,
                    "replica": r.index,
                    "pid": r.proc.pid if r.proc is not None else 0,
                    "state": r.state,
                    "restarts": r.restarts,
                }
                for r in self.replicas
            ],
        }
        write_state(self.run_dir, state)
