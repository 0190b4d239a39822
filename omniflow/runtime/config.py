"""Deployment config: TOML → typed msgspec structs, checked whole before any process starts.

Every table is a Struct (ranges and choices in ``Meta``); each role's ``options`` table is
checked against the Struct its actor declares (omniflow.runtime.loading). An error names
the file, the table and the field:

    configs/x.toml: [roles.llm.options] hidden_sise: unknown option (did you mean hidden_size?)
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from omniflow.control.graph import GraphError, Plan, graph_from_edges
from omniflow.memory.config import CacheConfig, parse_size
from omniflow.runtime.gateway_config import GatewayConfig as GatewayConfig
from omniflow.runtime.tables import FieldError, decode
from omniflow.transport.security import Keys, KeysError, load_keys
from omniflow.transport.security import generate_keys as generate_keys  # for `omniflow keys`

_STRICT = {"forbid_unknown_fields": True, "omit_defaults": True}
re_host_id = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, table and field."""


class RoleConfig(msgspec.Struct, **_STRICT):
    actor: Annotated[
        str,
        Meta(pattern=r"^[\w.]+:\w+$", description="the Actor subclass, package.module:ClassName"),
    ]
    replicas: Annotated[int, Meta(ge=1, description="processes running this role")] = 1
    max_concurrency: Annotated[
        int, Meta(ge=1, description="requests one replica works on at once")
    ] = 64
    max_queue: Annotated[
        int, Meta(ge=0, description="requests waiting beyond those; more are refused")
    ] = 1024
    max_stream_chunks: Annotated[
        int, Meta(ge=1, description="one streamed request's chunks waiting; more: overloaded")
    ] = 1024
    policy: Annotated[
        str, Meta(description="how producers pick a replica: round_robin, prefix_aware, ...")
    ] = "round_robin"
    idempotent: Annotated[
        bool, Meta(description="a dead replica's request may be retried on another")
    ] = False
    gpus: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description="GPU ids")] = []
    options: Annotated[dict[str, Any], Meta(description="the actor's own options (below)")] = {}


class EdgeConfig(msgspec.Struct, **_STRICT, rename={"src": "from", "dst": "to"}):
    src: Annotated[str, Meta(description='a role, or "input"')]
    dst: Annotated[str, Meta(description="a role")]
    when: Annotated[
        str | None, Meta(description="a predicate: has_image, has:KEY, not:NAME, module:fn")
    ] = None
    stream: Annotated[bool, Meta(description="forward each output as a chunk at once")] = False
    max_iters: Annotated[int, Meta(ge=0, description="a loop edge's bound")] = 0


class GraphConfig(msgspec.Struct, **_STRICT):
    edges: list[EdgeConfig]


Seconds = Annotated[float, Meta(gt=0)]


class RuntimeConfig(msgspec.Struct, **_STRICT):
    run_dir: Annotated[str, Meta(description="default: /tmp/omniflow-<uid>/<name>")] = ""
    transport: Annotated[
        Literal["ipc", "tcp"], Meta(description="ipc on one host, tcp to reach across hosts")
    ] = "ipc"
    bind_host: Annotated[str, Meta(description="address tcp endpoints bind")] = "127.0.0.1"
    heartbeat_s: Annotated[float, Meta(gt=0, description="registry keepalive period")] = 0.5
    ttl_s: Annotated[
        float, Meta(gt=0, description="a replica silent this long drops out (> heartbeat_s)")
    ] = 3.0
    start_timeout_s: Annotated[float, Meta(gt=0, description="for every actor's setup")] = 60.0
    drain_timeout_s: Annotated[
        float, Meta(ge=0, description="in-flight requests get this long at shutdown")
    ] = 10.0
    send_timeout_s: Annotated[
        float, Meta(gt=0, description="a peer that takes nothing this long counts as dead")
    ] = 2.0
    request_timeout_s: Annotated[
        float, Meta(ge=0, description="deadline of a request that names none (0: none)")
    ] = 300.0
    restart_backoff_s: Annotated[
        float, Meta(ge=0, description="first wait before restarting a dead worker")
    ] = 0.5
    restart_backoff_max_s: Annotated[
        float, Meta(ge=0, description="the backoff doubles up to this")
    ] = 10.0
    max_migrations: Annotated[
        int,
        Meta(ge=0, description="times a request on a dead replica moves to another (0: off)"),
    ] = 3
    inbox_hwm: Annotated[
        int,
        Meta(ge=1, description="messages an actor queues per sender unread (then it waits)"),
    ] = 1000
    host_id: Annotated[
        str,
        Meta(
            pattern=r"^[A-Za-z0-9_.-]{0,63}$",
            description="this host's id in the registry; one id, shared memory (default: hostname)",
        ),
    ] = ""
    max_message_size: Annotated[
        str | int,
        Meta(
            description="largest frame a socket reads; a larger one drops its sender (tcp tensors)"
        ),
    ] = "1GiB"
    max_prompt_chars: Annotated[
        int, Meta(ge=1, description="a longer string in a request is refused before any work")
    ] = 1_000_000

    def __post_init__(self) -> None:
        if parse_size(self.max_message_size, "runtime.max_message_size") < (1 << 20):
            raise ValueError(
                f"runtime.max_message_size: must be at least 1MiB, got {self.max_message_size!r}"
            )

    @property
    def max_message_bytes(self) -> int:
        return parse_size(self.max_message_size)


class HostConfig(msgspec.Struct, **_STRICT):
    """[hosts.NAME]: one host of a deployment spread over several on one etcd."""

    roles: Annotated[
        list[str], Meta(description="roles this host runs (`omniflow up --roles` overrides)")
    ] = []
    address: Annotated[
        str, Meta(description="where the other hosts reach this host's actors (tcp)")
    ] = ""
    bind: Annotated[
        str, Meta(description='address its sockets bind (default: address; "0.0.0.0" behind NAT)')
    ] = ""


class DeviceGroup(msgspec.Struct, **_STRICT):
    """Roles co-located on one device, each with a fraction of its free memory."""

    device: Annotated[str, Meta(pattern=r"^(cpu|cuda:\d+)$", description="the device shared")] = (
        "cpu"
    )
    fractions: Annotated[
        dict[str, Annotated[float, Meta(gt=0, le=1)]],
        Meta(description="role -> share of the free memory (0, 1], summing to <= 1"),
    ] = {}


class ResourcesConfig(msgspec.Struct, **_STRICT):
    # Co-located roles finish setup() (weights) before any measures free memory
    # and sizes its KV pool: a registry barrier over every replica in the group.
    kv_barrier: Annotated[
        bool, Meta(description="a group's roles load weights before any sizes its KV")
    ] = True
    barrier_timeout_s: Annotated[float, Meta(gt=0, description="wait for that at most")] = 120.0
    groups: Annotated[dict[str, DeviceGroup], Meta(description="[resources.groups.NAME]")] = {}

    def group_of(self, role: str) -> tuple[str, DeviceGroup] | None:
        for name, group in self.groups.items():
            if role in group.fractions:
                return name, group
        return None


class SecurityConfig(msgspec.Struct, **_STRICT):
    """[security]: CurveZMQ on every tcp:// socket (required with tcp, loopback too)."""

    keys: Annotated[
        str, Meta(description="folder from `omniflow keys DIR`; relative to the config file")
    ] = ""

    def load_keys(self) -> Keys | None:
        """The deployment's key pairs, or None when it runs without CurveZMQ."""
        return load_keys(self.keys) if self.keys else None


GATEWAY_ROLE = "gateway"
GATEWAY_ACTOR = "omniflow.roles.gateway:Gateway"


class TracingConfig(msgspec.Struct, **_STRICT):
    """[tracing]: OpenTelemetry spans of every role a request goes through."""

    endpoint: Annotated[
        str, Meta(description="OTLP/HTTP traces URL (http://HOST:4318/v1/traces); set: on")
    ] = ""
    enabled: Annotated[
        bool, Meta(description="record spans even without an endpoint (dropped)")
    ] = False
    service: Annotated[str, Meta(description="service.name of the spans ('': omniflow)")] = ""

    @property
    def on(self) -> bool:
        return bool(self.endpoint) or self.enabled


class Config(msgspec.Struct, **_STRICT):
    name: Annotated[
        str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,40}$", description="names the deployment")
    ]
    roles: Annotated[dict[str, RoleConfig], Meta(min_length=1, description="[roles.NAME]")]
    graph: Annotated[GraphConfig, Meta(description="edges between roles")]
    registry: Annotated[
        str, Meta(pattern=r"^(embedded|etcd://.+)$", description="embedded or etcd://host:port")
    ] = "embedded"
    runtime: Annotated[RuntimeConfig, Meta(description="[runtime]")] = msgspec.field(
        default_factory=RuntimeConfig
    )
    resources: Annotated[ResourcesConfig, Meta(description="co-located roles' memory shares")] = (
        msgspec.field(default_factory=ResourcesConfig)
    )
    cache: Annotated[CacheConfig, Meta(description='[cache] (host_pool "256MiB" when absent)')] = (
        msgspec.field(default_factory=lambda: CacheConfig(host_pool="256MiB"))
    )
    gateway: Annotated[
        GatewayConfig | None, Meta(description="[gateway] (absent: no HTTP server)")
    ] = None
    security: Annotated[SecurityConfig, Meta(description="[security] CurveZMQ keys")] = (
        msgspec.field(default_factory=SecurityConfig)
    )
    hosts: Annotated[
        dict[str, HostConfig], Meta(description="[hosts.NAME] (absent: one host runs it all)")
    ] = {}
    tracing: Annotated[TracingConfig, Meta(description="[tracing] OpenTelemetry spans")] = (
        msgspec.field(default_factory=TracingConfig)
    )
    source: str = ""  # the file this came from (filled by load)

    @property
    def host_id(self) -> str:
        """This host's id: what the registry records and locality compare (same id: the
        same shared memory). Processes in different network namespaces of one machine
        share a hostname, so a multi-host deployment names its hosts explicitly."""
        return self.runtime.host_id or socket.gethostname()

    def local_processes(self) -> dict[str, RoleConfig]:
        """The roles this host runs: those its [hosts] entry names, or all of them."""
        host = self.hosts.get(self.host_id)
        processes = self.processes()
        if host is None or not host.roles:
            return processes
        return {name: rc for name, rc in processes.items() if name in host.roles}

    def addresses(self) -> tuple[str, str]:
        """(bind, advertise) of this host's tcp sockets: its [hosts] entry's, else
        [runtime] bind_host for both."""
        host = self.hosts.get(self.host_id)
        if host is None or not host.address:
            return self.runtime.bind_host, self.runtime.bind_host
        return host.bind or host.address, host.address

    def plan(self) -> Plan:
        return build_plan(self, self.source or "<config>")

    def processes(self) -> dict[str, RoleConfig]:
        """Every role a process runs: the graph's, and the gateway (outside the graph)."""
        if self.gateway is None:
            return self.roles
        options = msgspec.to_builtins(self.gateway)
        gateway = RoleConfig(GATEWAY_ACTOR, options=options, max_concurrency=1, max_queue=0)
        return {**self.roles, GATEWAY_ROLE: gateway}


def parse(raw: dict[str, Any], source: str = "<config>") -> Config:
    try:
        config = decode(raw, Config)
        config.source = source
        check_options(config)
    except ValueError as e:  # a FieldError, or [cache]'s __post_init__ naming its field
        raise ConfigError(f"{source}: {e}") from None
    validate(config, source)
    return config


def check_options(config: Config) -> None:
    """Each role's options against its actor's Struct (importing what the actor names)."""
    from omniflow.runtime.loading import options_type

    for name, role in config.roles.items():
        try:
            options = options_type(role.actor)
        except (ImportError, AttributeError, TypeError) as e:
            field = f'actor = "{role.actor}"'
            raise FieldError(field, f"cannot load: {e}", ("roles", name)) from None
        if options is not None:
            decode(role.options, options, ("roles", name, "options"), "option")


def load(path: str | Path) -> Config:
    path = Path(path)
    source = str(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    try:
        raw = msgspec.toml.decode(text)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    keys = raw.get("security", {}).get("keys") if isinstance(raw.get("security"), dict) else None
    if isinstance(keys, str) and keys and not Path(keys).expanduser().is_absolute():
        raw["security"]["keys"] = os.path.normpath(
            path.resolve().parent / keys
        )  # as the file means
    config = parse(raw, source)
    config.source = str(path.resolve())
    return config


def validate(config: Config, source: str) -> None:
    """What the Structs cannot say: checks across fields and tables."""
    for name, role in config.roles.items():
        _check_policy(f"{source}: [roles.{name}] policy", role.policy)
    if config.gateway is not None and GATEWAY_ROLE in config.roles:
        raise ConfigError(f"{source}: [roles.{GATEWAY_ROLE}]: the name is [gateway]'s")
    rt = config.runtime
    if rt.ttl_s <= rt.heartbeat_s:
        raise ConfigError(f"{source}: [runtime] ttl_s: must exceed heartbeat_s")
    _check_resources(config, source)
    _check_devices(config, source)
    _check_hosts(config, source)
    _check_exposure(config, source)
    build_plan(config, source)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket on this machine (127/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname, "*", an interface name: reachable from elsewhere


def _check_hosts(config: Config, source: str) -> None:
    """[hosts]: known roles, one etcd, tcp between hosts. A role no entry names may run
    on a host that joins with ``omniflow up --host-id H --roles ...`` alone."""
    if not config.hosts:
        return
    if not config.registry.startswith("etcd://"):
        raise ConfigError(
            f"{source}: [hosts]: hosts find each other through etcd: set registry = "
            '"etcd://HOST:PORT"'
        )
    if config.runtime.transport != "tcp":
        raise ConfigError(
            f'{source}: [hosts]: actors on several hosts need [runtime] transport = "tcp"'
        )
    processes = config.processes()
    for name, host in config.hosts.items():
        if not re_host_id.match(name):
            raise ConfigError(f"{source}: [hosts.{name}]: a host id is letters, digits, _ . -")
        for role in host.roles:
            if role not in processes:
                known = ", ".join(processes)
                raise ConfigError(
                    f"{source}: [hosts.{name}] roles: unknown role {role!r} ({known})"
                )


def _check_exposure(config: Config, source: str) -> None:
    """Every tcp socket is authenticated (CurveZMQ keys), and off loopback the gateway
    needs its API key."""
    rt, security = config.runtime, config.security
    for name, host in config.hosts.items():
        for address in filter(None, (host.address, host.bind)):
            if not is_loopback(address) and not security.keys:
                raise ConfigError(
                    f"{source}: [hosts.{name}] {address!r} is not a loopback address: set "
                    "[security] keys = DIR (make them with `omniflow keys DIR`, copy them to "
                    "every host) so that peers must hold the deployment's CurveZMQ keys"
                )
    if rt.transport == "tcp" and not is_loopback(rt.bind_host) and not security.keys:
        raise ConfigError(
            f"{source}: [runtime] bind_host = {rt.bind_host!r} is not a loopback address: "
            "set [security] keys = DIR (make them with `omniflow keys DIR`) so that peers "
            "must hold the deployment's CurveZMQ keys"
        )
    if rt.transport == "tcp" and not security.keys:  # any local user can dial a tcp port
        raise ConfigError(
            f'{source}: [runtime] transport = "tcp" (as on several hosts) needs [security] '
            "keys = DIR, even on loopback: any local user may connect to a tcp port (make them "
            'with `omniflow keys DIR`; on one host, transport = "ipc" needs none)'
        )
    if security.keys:
        try:
            security.load_keys()
        except KeysError as e:
            raise ConfigError(f"{source}: [security] keys: {e}") from None
    gw = config.gateway
    if gw is not None and not is_loopback(gw.host) and not gw.api_key:
        raise ConfigError(
            f"{source}: [gateway] host = {gw.host!r} is not a loopback address: set "
            "[gateway] api_key so that callers must present it"
        )


def _check_resources(config: Config, source: str) -> None:
    seen: dict[str, str] = {}
    for name, group in config.resources.groups.items():
        where = f"{source}: [resources.groups.{name}] fractions"
        for role in group.fractions:
            if role not in config.roles:
                raise ConfigError(f"{where}.{role}: unknown role")
            if role in seen:
                raise ConfigError(f"{where}.{role}: already in group {seen[role]!r}")
            seen[role] = name
        total = sum(group.fractions.values())
        if total > 1.0 + 1e-9:
            raise ConfigError(f"{where}: sum to {total:g}, more than the whole device")


def _check_devices(config: Config, source: str) -> None:
    """The roles this host runs: ``device = "cuda"`` needs a GPU here, ``gpus`` must split."""
    from omniflow.runtime.gpus import device_problem

    for name, role in config.local_processes().items():
        problem = device_problem(role.options, role.gpus, role.replicas)
        if problem:
            raise ConfigError(f"{source}: [roles.{name}]: {problem}")


def _check_policy(where: str, name: str) -> None:
    from omniflow.control.balance import make_policy

    try:
        make_policy(name)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def build_plan(config: Config, source: str) -> Plan:
    specs = [
        {"from": e.src, "to": e.dst, "when": e.when, "stream": e.stream, "max_iters": e.max_iters}
        for e in config.graph.edges
    ]
    try:
        return graph_from_edges(specs).compile(config.roles)
    except GraphError as e:
        raise ConfigError(f"{source}: [graph] {e}") from None


def to_json(config: Config) -> bytes:
    return msgspec.json.encode(config)


def from_json(data: bytes) -> Config:
    return msgspec.json.decode(data, type=Config)
