"""CurveZMQ off loopback: keys from `omniflow keys`, a keyed deployment on 127.0.0.2 that
serves keyed peers and refuses keyless and wrong-key ones at the handshake, and the
config rules that make an exposed bind without keys an error at load."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

import omniflow
from omniflow.messages import Call, Emit
from omniflow.runtime.config import ConfigError, load, parse
from omniflow.transport.codec import decode, encode
from omniflow.transport.security import Gatekeeper, load_keys, secure_client, secure_server
from tests.helpers import cli

HOST = "127.0.0.2"  # Linux routes all of 127/8 to lo: a second address, no namespace needed


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sec") / "keys"
    out = cli("keys", str(folder)).stdout
    assert "[security] keys" in out
    return folder


def test_keys_are_owner_only_and_not_overwritten(keys) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    assert (keys / "authorized" / "client.key").read_text() == (keys / "client.key").read_text()
    again = cli("keys", str(keys), check=False)
    assert again.returncode == 2 and "already holds keys" in again.stderr


def _raw(extra: dict) -> dict:
    return {
        "name": "cz",
        "roles": {"upper": {"actor": "omniflow.roles.echo:Upper"}},
        "graph": {"edges": [{"from": "input", "to": "upper"}]},
        **extra,
    }


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "*", "myhost.example"])
def test_a_non_loopback_bind_without_keys_fails_at_load(host) -> None:
    with pytest.raises(ConfigError, match=r"\[runtime\] bind_host .* not a loopback address"):
        parse(_raw({"runtime": {"transport": "tcp", "bind_host": host}}))


def test_tcp_needs_keys_even_on_loopback_and_loads_with_them(keys) -> None:
    for host in ("127.0.0.1", HOST, "::1", "localhost"):
        with pytest.raises(ConfigError, match=r'transport = "tcp" .*needs \[security\] keys'):
            parse(_raw({"runtime": {"transport": "tcp", "bind_host": host}}))
        parse(
            _raw(
                {
                    "runtime": {"transport": "tcp", "bind_host": host},
                    "security": {"keys": str(keys)},
                }
            )
        )
    exposed = {"transport": "tcp", "bind_host": "0.0.0.0"}
    config = parse(_raw({"runtime": exposed, "security": {"keys": str(keys)}}))
    assert config.security.load_keys() == load_keys(keys)


def test_a_keys_folder_that_leaks_or_is_missing_fails_at_load(keys, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\[security\] keys: .*server.key_secret"):
        parse(_raw({"security": {"keys": str(tmp_path / "none")}}))
    loose = tmp_path / "loose"
    cli("keys", str(loose))
    os.chmod(loose / "client.key_secret", 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        parse(_raw({"security": {"keys": str(loose)}}))


def test_keys_path_is_relative_to_the_config_file(keys, tmp_path) -> None:
    toml = tmp_path / "d.toml"
    rel = os.path.relpath(keys, tmp_path)
    toml.write_text(
        'name = "cz"\n[roles.upper]\nactor = "omniflow.roles.echo:Upper"\n'
        '[graph]\nedges = [{ from = "input", to = "upper" }]\n'
        f'[security]\nkeys = "{rel}"\n'
    )
    assert load(toml).security.keys == str(keys)


def test_an_exposed_gateway_needs_an_api_key() -> None:
    with pytest.raises(ConfigError, match=r"\[gateway\] host .* set \[gateway\] api_key"):
        parse(_raw({"gateway": {"host": "0.0.0.0"}}))
    parse(_raw({"gateway": {"host": "0.0.0.0", "api_key": "k"}}))


# ------------------------------------------------------------ a keyed deployment


def _send_and_wait(dealer: zmq.Socket, replies: zmq.Socket, rid: str, timeout_ms: int) -> object:
    reply_to = replies.getsockopt_string(zmq.LAST_ENDPOINT)
    call = Call(rid, "upper", reply_to, data={"text": "hi"}, credit=1, token=b"c" * 16)
    dealer.send(encode(call))
    if not replies.poll(timeout_ms):
        return None
    return decode(replies.recv_multipart()[1])


def test_keyed_peers_are_served_keyless_and_wrong_key_refused(keys, run_root) -> None:
    config = parse(
        _raw(
            {
                "runtime": {"transport": "tcp", "bind_host": HOST},
                "security": {"keys": str(keys)},
            }
        )
    )
    good = load_keys(keys)
    stranger = zmq.auth.create_certificates(str(run_root), "stranger")
    s_public, s_secret = zmq.auth.load_certificate(stranger[1])

    ctx = zmq.Context()
    replies = ctx.socket(zmq.ROUTER)  # a keyed reply socket: any message that got in answers
    replies.setsockopt(zmq.LINGER, 0)

    async def probe():
        async with omniflow.Runtime(config) as rt:
            outs, _ = await rt.call({"text": "through curve"})  # the deployment's own client
            words = [o.data["text"] for o in outs]
            replica = rt.supervisor.replicas[0]
            assert replica.endpoint.startswith(f"tcp://{HOST}:")
            secure_server(replies, good)
            replies.bind(f"tcp://{HOST}:*")
            results = {}
            for name, setup in {
                "keyless": lambda s: None,
                "wrong_key": lambda s: _curve_as(s, good.server_public, s_public, s_secret),
                "keyed": lambda s: secure_client(s, good),
            }.items():
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                setup(dealer)
                dealer.connect(replica.endpoint)
                wait = 10_000 if name == "keyed" else 1500
                results[name] = await asyncio.to_thread(
                    _send_and_wait, dealer, replies, f"r-{name}", wait
                )
                dealer.close(0)
            log_path = rt.supervisor.run_dir / "logs" / "upper-0.log"
            deadline = time.monotonic() + 10
            # Wrong key: the ZAP handler's line. Keyless: the monitor's (its event is
            # HANDSHAKE_FAILED_PROTOCOL, or NO_DETAIL when the peer hangs up first).
            logged = ("Unknown key", "refused a CURVE handshake on tcp://")
            while not all(w in log_path.read_text() for w in logged):
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                await asyncio.sleep(0.1)
            return words, results, log_path.read_text()

    try:
        words, results, log_text = asyncio.run(probe())
    finally:
        replies.close(0)
        Gatekeeper.release(ctx)  # its ZAP thread holds a socket of ctx
        ctx.term()
    assert words == ["THROUGH ", "CURVE"]
    assert results["keyless"] is None and results["wrong_key"] is None
    keyed = results["keyed"]
    assert isinstance(keyed, Emit) and keyed.data["text"] == "HI"
    refusals = [line for line in log_text.splitlines() if "refused a CURVE handshake" in line]
    assert len(refusals) == 2, refusals  # keyless ones retry every 100 ms: rate-limited


def _curve_as(sock: zmq.Socket, server_public: bytes, public: bytes, secret: bytes) -> None:
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
