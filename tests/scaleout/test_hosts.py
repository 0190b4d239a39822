"""Host identity and one host's share, without namespaces: locality by host id, the config
a host runs, replica numbers claimed in a real etcd, an advertised tcp endpoint."""

from __future__ import annotations

import asyncio
import functools
import socket
import tempfile
from pathlib import Path

import msgspec
import pytest
import uvloop
import zmq

from omniflow.control.discovery.etcd import EtcdRegistry
from omniflow.control.routing import Router
from omniflow.messages import ActorRecord
from omniflow.runtime.config import ConfigError, generate_keys, parse
from omniflow.runtime.hosts import (
    HostRecord,
    HostShare,
    for_host,
    list_hosts,
    read_config,
    stop_all,
)
from omniflow.transport.endpoint import Inbox
from tests.helpers import echo_config

ECHO = "omniflow.roles.echo"


@functools.cache
def tcp_keys() -> str:
    """One CurveZMQ keys folder for this module's tcp configs (tcp needs keys)."""
    folder = Path(tempfile.mkdtemp(prefix="ofk-")) / "keys"
    generate_keys(str(folder))
    return str(folder)


def two_roles(keys: bool = True, **extra) -> dict:
    raw = {
        "name": "spread",
        "roles": {"upper": {"actor": f"{ECHO}:Upper"}, "reverse": {"actor": f"{ECHO}:Reverse"}},
        "graph": {"edges": [{"from": "input", "to": "upper"}, {"from": "upper", "to": "reverse"}]},
        **extra,
    }
    shared = str(extra.get("registry", "")).startswith("etcd")  # for_host makes it tcp
    if keys and (shared or extra.get("runtime", {}).get("transport") == "tcp"):
        raw["security"] = {"keys": tcp_keys()}
    return raw


def record(host: str, pid: int = 7) -> ActorRecord:
    return ActorRecord("upper", 0, pid, "tcp://198.18.0.2:5000", host, [0])


def test_locality_is_the_host_id_not_the_hostname():
    router = Router(echo_config().plan(), None, None, {}, host="a")  # type: ignore[arg-type]
    assert router.link(record("a")).same_host
    # another namespace of this very machine: the same hostname, another host id
    assert not router.link(record("b")).same_host
    assert router.link(record("b")).pid == 7


def test_the_host_id_defaults_to_the_hostname():
    assert echo_config().host_id == socket.gethostname()
    assert echo_config(runtime={"host_id": "rack1-gpu3"}).host_id == "rack1-gpu3"


def test_a_hosts_share_runs_its_roles_on_its_address():
    hosts = {"a": {"roles": ["upper"], "address": "127.0.0.2"}, "b": {"roles": ["reverse"]}}
    config = parse(two_roles(registry="etcd://127.0.0.1:2379", hosts=hosts,
                             runtime={"transport": "tcp"}))  # fmt: skip
    a = for_host(config, "a")
    assert list(a.local_processes()) == ["upper"] and a.addresses() == ("127.0.0.2", "127.0.0.2")
    assert a.host_id == "a" and a.runtime.transport == "tcp"
    b = for_host(config, "b", address="127.0.0.3")
    assert list(b.local_processes()) == ["reverse"] and b.addresses()[1] == "127.0.0.3"
    # a host the table does not name joins with its roles given
    c = for_host(config, "c", roles=["upper", "reverse"])
    assert list(c.local_processes()) == ["upper", "reverse"]
    with pytest.raises(ConfigError, match=r"host 'c' is not in \[hosts\] \(a, b\)"):
        for_host(config, "c")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hosts": {"a": {"roles": ["uper"]}}}, r"\[hosts.a\] roles: unknown role 'uper'"),
        (
            {"registry": "embedded", "hosts": {"a": {}}},
            r"\[hosts\]: hosts find each other through etcd",
        ),
        (
            {"hosts": {"a": {"address": "198.18.0.2"}}},
            r"\[hosts.a\] '198.18.0.2' is not a loopback address: set \[security\] keys",
        ),
        ({"hosts": {"a b": {}}}, r"\[hosts.a b\]: a host id is letters"),
    ],
)
def test_bad_hosts_tables_are_refused_naming_the_field(change, message):
    raw = two_roles(False, registry="etcd://127.0.0.1:2379", runtime={"transport": "tcp"})
    raw.update(change)
    with pytest.raises(ConfigError, match=message):
        parse(raw, "spread.toml")


def test_a_bad_host_id_on_the_command_line_names_the_field():
    config = parse(two_roles(registry="etcd://127.0.0.1:2379"))
    with pytest.raises(ConfigError, match="host_id"):
        for_host(config, "no spaces")
    with pytest.raises(ConfigError, match="unknown role 'nope'"):
        for_host(config, "a", roles=["nope"])


def test_an_inbox_bound_on_every_interface_advertises_a_reachable_address():
    ctx = zmq.Context()
    got: list[bytes] = []
    inbox = Inbox(ctx, "tcp://0.0.0.0:*", lambda identity, parts: got.append(parts[0]),
                  advertise="127.0.0.1")  # fmt: skip
    try:
        assert inbox.endpoint.startswith("tcp://127.0.0.1:")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(inbox.endpoint)
        dealer.send(b"hello")
        assert inbox._sock.poll(5000)
        assert inbox._sock.recv_multipart()[1] == b"hello"
        dealer.close(0)
    finally:
        inbox.close()
        ctx.term()


@pytest.mark.etcd
def test_hosts_claim_distinct_replica_numbers_and_free_them_with_their_lease(etcd_url):
    base = parse(two_roles(registry=etcd_url, runtime={"ttl_s": 2.0}))

    async def body():
        registries = [EtcdRegistry.from_url(etcd_url) for _ in range(4)]

        def share(host: str, registry: EtcdRegistry) -> HostShare:
            return HostShare(for_host(base, host, roles=["upper"]), registry)

        try:
            a, b, c = (share(h, r) for h, r in zip("abc", registries, strict=False))
            assert await a.claim_replicas({"upper": 2}) == {"upper": [0, 1]}
            taken = await b.claim_replicas({"upper": 1, "reverse": 1})
            assert taken == {"upper": [2], "reverse": [0]}
            assert await a.claim_replicas({"upper": 2}) == {"upper": [0, 1]}  # asked again
            await a.announce(HostRecord("a", ["upper"], "127.0.0.1", 1))
            assert [h.host for h in await list_hosts(registries[1], "spread")] == ["a"]
            published = await read_config(registries[2], "spread")
            assert published.runtime.host_id == "" and list(published.roles) == ["upper", "reverse"]
            # a's supervisor restarts (a new lease) before its old lease expired: its
            # numbers are its own again, and stay taken when the old lease goes
            restarted = share("a", registries[3])
            assert await restarted.claim_replicas({"upper": 2}) == {"upper": [0, 1]}
            await a.close()
            await registries[0].close()
            assert await c.claim_replicas({"upper": 1}) == {"upper": [3]}
            assert await list_hosts(registries[1], "spread") == []  # a's record went with it
            await registries[3].close()  # now a's numbers are free
            assert await c.claim_replicas({"upper": 3}) == {"upper": [0, 1, 3]}
            assert await stop_all(registries[1], "spread", timeout=1.0) == []
        finally:
            for r in registries:
                await r.close()

    uvloop.run(body())


@pytest.mark.etcd
def test_down_all_reaches_every_hosts_watch(etcd_url):
    base = parse(two_roles(registry=etcd_url, runtime={"ttl_s": 2.0}))

    async def body():
        registries = [EtcdRegistry.from_url(etcd_url) for _ in range(3)]
        stopped: dict[str, float | None] = {}
        shares = []
        try:
            for host, registry in zip("ab", registries[:2], strict=True):
                share = HostShare(for_host(base, host, roles=["upper"]), registry)
                await share.announce(HostRecord(host, ["upper"]))

                def stop(timeout, host=host, registry=registry):
                    stopped[host] = timeout
                    asyncio.get_running_loop().create_task(registry.close())  # its lease goes

                share.on_down(stop)
                shares.append(share)
            await asyncio.sleep(0)  # the watch tasks start: from here they see the put
            assert await stop_all(registries[2], "spread", timeout=5.0) == ["a", "b"]
            assert stopped == {"a": 5.0, "b": 5.0}
            assert await registries[2].list("/omniflow/spread/down") == []
        finally:
            for share in shares:
                await share.close()
            for r in registries:
                await r.close()

    uvloop.run(body())


def test_up_on_an_etcd_nobody_serves_fails_naming_the_host(tmp_path, run_root):
    from tests.etcd_server import free_port
    from tests.helpers import cli

    config = tmp_path / "spread.toml"
    config.write_text(
        'name = "spread"\n'
        f'registry = "etcd://127.0.0.1:{free_port()}"\n'
        f'[roles.upper]\nactor = "{ECHO}:Upper"\n'
        '[graph]\nedges = [{ from = "input", to = "upper" }]\n'
        f'[security]\nkeys = "{tcp_keys()}"\n'
    )
    proc = cli("up", str(config), "--host-id", "a", "--roles", "upper", check=False, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "host a could not join" in proc.stderr
    assert not list(run_root.rglob("*.sock"))


@pytest.mark.etcd
def test_two_hosts_embedded_in_one_program_serve_one_request_together(etcd_url, run_root):
    """Two shares on loopback, each a Runtime: upper on host a, reverse on host b. One
    machine and hostname, two host ids: two run dirs, two pools, frames between them."""
    from omniflow.control.discovery import list_actors
    from omniflow.runtime.deployment import Runtime
    from tests.helpers import expected_echo

    base = echo_config("pair", runtime={"ttl_s": 2.0})
    raw = msgspec.to_builtins(base)
    raw.update(registry=etcd_url)
    raw["runtime"]["transport"] = "tcp"
    raw["security"] = {"keys": tcp_keys()}
    config = parse(raw)

    async def body():
        a = await Runtime(for_host(config, "a", roles=["upper"])).start()
        try:
            b = await Runtime(for_host(config, "b", roles=["reverse"])).start()
            try:
                outputs, result = await a.call({"text": "across two hosts"}, timeout=30)
                assert [o.data["text"] for o in outputs] == expected_echo("across two hosts")
                assert {t.role for t in result.timings} == {"upper", "reverse"}
                actors = await list_actors(a.client.registry, "pair")
                assert {(r.role, r.host) for r in actors} == {("upper", "a"), ("reverse", "b")}
                assert a.run_dir.name == "pair@a" and b.run_dir.name == "pair@b"
                assert a.supervisor.pool_name != b.supervisor.pool_name
            finally:
                await b.close()
        finally:
            await a.close()

    uvloop.run(body())


def test_up_on_a_host_the_table_does_not_name_asks_for_its_roles(tmp_path, run_root):
    from tests.helpers import cli

    config = tmp_path / "spread.toml"
    config.write_text(
        'name = "spread"\nregistry = "etcd://127.0.0.1:2379"\n'
        f'[roles.upper]\nactor = "{ECHO}:Upper"\n'
        '[graph]\nedges = [{ from = "input", to = "upper" }]\n'
        '[runtime]\ntransport = "tcp"\n'
        f'[security]\nkeys = "{tcp_keys()}"\n'
        '[hosts.gpu7]\nroles = ["upper"]\n'
    )
    proc = cli("up", str(config), check=False, timeout=60)  # this machine is not gpu7
    assert proc.returncode == 2, proc.stderr
    assert f"host '{socket.gethostname()}' is not in [hosts] (gpu7)" in proc.stderr
    assert "--roles" in proc.stderr
    assert not any(run_root.iterdir())
