"""Registry fixtures: a real etcd server, and ``registry`` over every backend.

``registry`` is a ``Backend``: ``backend.run(body)`` runs ``body(backend)`` on a
fresh uvloop loop (the runtime's loop), with the embedded server started in
that loop when the backend needs one; ``await backend.client()`` opens a client
that is closed when the body returns; ``backend.child_factory`` is Python source
that builds a client in another process.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from tests.etcd_server import free_port


class Backend:
    """One registry backend as the shared suite sees it."""

    def __init__(self, name: str, address: str, child_factory: str):
        self.name = name
        self.address = address
        self.child_factory = child_factory  # a Python expression; ``address`` is in scope
        self._clients: list[Any] = []
        self._embedded: Any = None

    async def client(self) -> Any:
        if self.name == "etcd":
            from omniflow.control.discovery.etcd import EtcdRegistry

            registry: Any = EtcdRegistry.from_url(self.address)
        else:
            registry = self._embedded.EmbeddedRegistry(self.address)
        self._clients.append(registry)
        return registry

    def run(self, body: Callable[[Backend], Awaitable[None]]) -> None:
        uvloop.run(self._run(body))

    async def _run(self, body: Callable[[Backend], Awaitable[None]]) -> None:
        server = None
        if self.name == "embedded":
            server = self._embedded.EmbeddedRegistryServer(self.address)
            await server.start()
        try:
            await body(self)
        finally:
            for registry in reversed(self._clients):
                await registry.close()
            self._clients.clear()
            if server is not None:
                await server.close()


def embedded_module() -> Any:
    return importlib.import_module("omniflow.control.discovery.embedded")


@pytest.fixture(params=["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
def registry(request: pytest.FixtureRequest) -> Backend:
    if request.param == "etcd":
        server = request.getfixturevalue("etcd_server")
        return Backend(
            "etcd",
            server.url,
            "__import__('omniflow.control.discovery.etcd', fromlist=['x']).EtcdRegistry.from_url(address)",
        )
    module = embedded_module()
    backend = Backend(
        "embedded",
        f"tcp://127.0.0.1:{free_port()}",
        "__import__('omniflow.control.discovery.embedded', fromlist=['x']).EmbeddedRegistry(address)",
    )
    backend._embedded = module
    return backend
