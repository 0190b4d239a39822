"""The private APIs omniflow's hot path rests on still exist and behave as used, and the
installed packages are the pinned ones (pyproject.toml): a pyzmq or uvicorn upgrade that
moves one fails here by name, not as a slow path or an AttributeError in a live gateway."""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import zmq
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("pyzmq", "uvicorn", "httptools")


def pinned_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"]]
    return {r.name: r for r in requirements if r.name in PINNED}


@pytest.mark.parametrize("name", PINNED)
def test_the_installed_version_is_the_pinned_one(name):
    requirement = pinned_requirements()[name]
    assert any(spec.operator in ("<", "==", "~=") for spec in requirement.specifier), (
        f"{name} has no upper bound in pyproject.toml ({requirement.specifier})"
    )
    assert requirement.specifier.contains(version(name)), (
        f"{name} {version(name)} is installed, pyproject.toml pins {requirement.specifier}: "
        "re-check the private APIs tests/test_private_apis.py names before moving the pin"
    )


def test_zmq_backend_send_is_the_cython_method_the_outbox_calls():
    from omniflow.transport import endpoint

    assert endpoint._raw_send is zmq.backend.Socket.send
    # pyzmq's Python wrapper overrides it (the cost the outbox skips), and is a subclass.
    assert issubclass(zmq.Socket, zmq.backend.Socket)
    assert zmq.Socket.send is not zmq.backend.Socket.send
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://private-api")
        b.connect("inproc://private-api")
        endpoint._raw_send(a, b"header", int(zmq.NOBLOCK))  # as Outbox.try_send calls it
        assert b.recv() == b"header"
        a.close(0)
        b.close(0)
    finally:
        ctx.term()


def test_uvicorn_protocol_and_server_hooks_the_gateway_uses():
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from omniflow.roles.gateway.protocol import GatewayProtocol

    assert issubclass(GatewayProtocol, HttpToolsProtocol)
    # GatewayProtocol wraps the transport in connection_made and relies on `self.loop`.
    params = inspect.signature(HttpToolsProtocol.connection_made).parameters
    assert list(params) == ["self", "transport"]
    assert "self.loop" in inspect.getsource(HttpToolsProtocol.__init__)
    for hook in ("startup", "shutdown"):
        assert "sockets" in inspect.signature(getattr(uvicorn.Server, hook)).parameters, hook
