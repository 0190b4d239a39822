"""The gateway role: a uvicorn server on this replica's event loop, a Client behind it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

from omniflow.roles.gateway.app import GatewayApp
from omniflow.roles.gateway.hostcheck import HostCheck
from omniflow.roles.gateway.limits import BodyGuard, limited_protocol, limits_of
from omniflow.roles.gateway.observe import Observe
from omniflow.roles.gateway.role_metrics import RoleMetrics
from omniflow.roles.options import NoParams
from omniflow.runtime.actor import Actor, BadRequest, Context, Request
from omniflow.runtime.client import Client
from omniflow.runtime.config import GatewayConfig, from_json
from omniflow.runtime.tracing import Tracer
from omniflow.transport.links import attached_pool

log = logging.getLogger("omniflow.gateway")


class Gateway(Actor):
    Options = GatewayConfig
    Params = NoParams
    options: GatewayConfig

    async def setup(self) -> None:
        import uvicorn

        # The supervisor names the run dir; the config is the deployment's own.
        self.run_dir = Path(os.environ["OMNIFLOW_RUN_DIR"])
        config = from_json((self.run_dir / "deployment.json").read_bytes())
        # The worker's pool (mapped already): outputs come back by handle, with no copy.
        self.client = Client(config, os.environ["OMNIFLOW_REGISTRY"], self.run_dir, attached_pool())
        await self.client.start()
        self.app = GatewayApp(self.client, config, self.options)
        # Every replica's figures, from the records this Client follows anyway.
        self.app.metrics.registry.register(RoleMetrics(self.client.view))
        # Bound here, not by uvicorn: port 0 then names the port it got, and a port in
        # use fails setup (and so `omniflow up`) with a message that names it.
        family = socket.AF_INET6 if ":" in self.options.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((self.options.host, self.options.port))
        except OSError as e:
            self.socket.close()
            await self.client.close()
            raise RuntimeError(
                f"the gateway cannot bind {self.options.host}:{self.options.port}: {e.strerror}"
            ) from None
        self.socket.setblocking(False)
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        self.tracer = Tracer(config.tracing, config.name, self.role, self.replica)
        limits = limits_of(self.options)  # fds for ZeroMQ kept out of max_connections
        guarded = HostCheck(
            BodyGuard(self.app, limits),
            self.options.host,
            self.options.allowed_hosts,
            self.options.cors_origins,
        )
        config_ = uvicorn.Config(
            Observe(guarded, self.tracer),  # trace context, span and access line
            log_config=None,  # uvicorn's loggers go through the worker's handler and format
            loop="none",  # this replica's uvloop
            http=limited_protocol(limits),  # httptools, each response in one send
            timeout_keep_alive=self.options.keepalive_timeout_s,
            lifespan="off",
            access_log=False,
            log_level="warning",
            server_header=False,
            timeout_graceful_shutdown=5,
        )
        config_.load()
        self.server = uvicorn.Server(config_)
        self.server.lifespan = config_.lifespan_class(config_)
        await self.server.startup(sockets=[self.socket])
        # main_loop only refreshes the Date header and watches should_exit.
        self._main = asyncio.create_task(self.server.main_loop())
        (self.run_dir / "gateway.url").write_text(self.url + "\n")
        log.info("gateway listening on %s", self.url)

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self._main
        await self.server.shutdown(sockets=[self.socket])
        await self.client.close()
        self.tracer.close()
        (self.run_dir / "gateway.url").unlink(missing_ok=True)

    async def handle(self, request: Request, ctx: Context) -> Any:
        raise BadRequest("gateway", "takes HTTP requests, not calls")

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "tracing": self.tracer.on}

    def meta(self) -> dict[str, Any]:
        return {"url": getattr(self, "url", "")}
