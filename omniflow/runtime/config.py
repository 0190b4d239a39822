"""Deployment config: TOML → typed msgspec structs, errors naming file and field.

configs/x.toml: roles.upper.replicas: expected int, got str
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from omniflow.cache.config import CacheConfig
from omniflow.control.graph import GraphError, Plan, graph_from_edges

_STRICT = {"forbid_unknown_fields": True, "omit_defaults": True}


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, table and field."""


class RoleConfig(msgspec.Struct, **_STRICT):
    actor: str  # "package.module:ClassName"
    replicas: int = 1
    max_concurrency: int = 64
    max_queue: int = 1024
    policy: str = "round_robin"
    idempotent: bool = False
    gpus: list[int] = []
    options: dict[str, Any] = {}


class EdgeConfig(msgspec.Struct, **_STRICT, rename={"src": "from", "dst": "to"}):
    src: str
    dst: str
    when: str | None = None
    stream: bool = False
    max_iters: int = 0


class GraphConfig(msgspec.Struct, **_STRICT):
    edges: list[EdgeConfig]


class RuntimeConfig(msgspec.Struct, **_STRICT):
    run_dir: str = ""  # default: /tmp/omniflow-<uid>/<name>
    transport: str = "ipc"  # "ipc" on one host, "tcp" to reach across hosts
    bind_host: str = "127.0.0.1"
    heartbeat_s: float = 0.5
    ttl_s: float = 3.0
    start_timeout_s: float = 60.0
    drain_timeout_s: float = 10.0
    send_timeout_s: float = 2.0  # a peer that takes nothing this long counts as dead
    request_timeout_s: float = 300.0  # the deadline of a request that names none (0: none)
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0


class DeviceGroup(msgspec.Struct, **_STRICT):
    """Roles co-located on one device, each with a fraction of its free memory."""

    device: str = "cpu"  # "cpu" or "cuda:N"
    fractions: dict[str, float] = {}


class ResourcesConfig(msgspec.Struct, **_STRICT):
    # Co-located roles finish setup() (weights) before any measures free memory
    # and sizes its KV pool: a registry barrier over every replica in the group.
    kv_barrier: bool = True
    barrier_timeout_s: float = 120.0
    groups: dict[str, DeviceGroup] = {}

    def group_of(self, role: str) -> tuple[str, DeviceGroup] | None:
        for name, group in self.groups.items():
            if role in group.fractions:
                return name, group
        return None


class Config(msgspec.Struct, **_STRICT):
    name: str
    roles: dict[str, RoleConfig]
    graph: GraphConfig
    registry: str = "embedded"  # or "etcd://host:port"
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)
    cache: CacheConfig = msgspec.field(default_factory=lambda: CacheConfig(host_pool="256MiB"))
    source: str = ""  # the file this came from (filled by load)

    def plan(self) -> Plan:
        return build_plan(self, self.source or "<config>")


_PATH = re.compile(r" - at `\$((?:\.[^`\[]+|\[\d+\])*)`$")
_TYPE = re.compile(r"^Expected `([^`]+)`, got `([^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]+)`")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def _friendly(source: str, error: Exception, prefix: str = "") -> ConfigError:
    text = str(error)
    m = _PATH.search(text)
    where = prefix + (m.group(1) if m else "")
    where = where.lstrip(".")
    what = text[: m.start()] if m else text
    if t := _TYPE.match(what):
        what = f"expected {t.group(1)}, got {t.group(2)}"
    elif u := _UNKNOWN.match(what):
        where = f"{where}.{u.group(1)}" if where else u.group(1)
        what = "unknown field"
    elif r := _MISSING.match(what):
        where = f"{where}.{r.group(1)}" if where else r.group(1)
        what = "missing required field"
    return ConfigError(f"{source}: {where}: {what}" if where else f"{source}: {what}")


def parse(raw: dict[str, Any], source: str = "<config>") -> Config:
    # msgspec reports a dict key as "[...]": check each role alone to name it.
    roles = raw.get("roles")
    if isinstance(roles, dict):
        for name, role in roles.items():
            try:
                msgspec.convert(role, RoleConfig)
            except msgspec.ValidationError as e:
                raise _friendly(source, e, prefix=f".roles.{name}") from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise _friendly(source, e) from None
    config.source = source
    validate(config, source)
    return config


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
    config = parse(raw, source)
    config.source = str(path.resolve())
    return config


def validate(config: Config, source: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", config.name):
        raise ConfigError(f"{source}: name: use 1-40 letters, digits, '_', '.', '-'")
    if not config.roles:
        raise ConfigError(f"{source}: roles: a deployment needs at least one role")
    for name, role in config.roles.items():
        where = f"{source}: roles.{name}"
        if ":" not in role.actor:
            raise ConfigError(f"{where}.actor: expected 'package.module:ClassName'")
        if role.replicas < 1:
            raise ConfigError(f"{where}.replicas: must be >= 1, got {role.replicas}")
        if role.max_concurrency < 1:
            raise ConfigError(f"{where}.max_concurrency: must be >= 1")
        if role.max_queue < 0:
            raise ConfigError(f"{where}.max_queue: must be >= 0")
        _check_policy(f"{where}.policy", role.policy)
    rt = config.runtime
    if rt.transport not in ("ipc", "tcp"):
        raise ConfigError(f"{source}: runtime.transport: expected 'ipc' or 'tcp'")
    if rt.ttl_s <= rt.heartbeat_s:
        raise ConfigError(f"{source}: runtime.ttl_s: must exceed runtime.heartbeat_s")
    if not (config.registry == "embedded" or config.registry.startswith("etcd://")):
        raise ConfigError(f"{source}: registry: expected 'embedded' or 'etcd://host:port'")
    _check_resources(config, source)
    build_plan(config, source)


def _check_resources(config: Config, source: str) -> None:
    seen: dict[str, str] = {}
    for name, group in config.resources.groups.items():
        where = f"{source}: resources.groups.{name}"
        if not re.fullmatch(r"cpu|cuda:\d+", group.device):
            raise ConfigError(f"{where}.device: expected 'cpu' or 'cuda:N', got {group.device!r}")
        for role, fraction in group.fractions.items():
            if role not in config.roles:
                raise ConfigError(f"{where}.fractions.{role}: unknown role")
            if role in seen:
                raise ConfigError(f"{where}.fractions.{role}: already in group {seen[role]!r}")
            if not 0 < fraction <= 1:
                raise ConfigError(f"{where}.fractions.{role}: must be in (0, 1], got {fraction}")
            seen[role] = name
        total = sum(group.fractions.values())
        if total > 1.0 + 1e-9:
            raise ConfigError(f"{where}.fractions: sum to {total:g}, more than the whole device")


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
        raise ConfigError(f"{source}: graph: {e}") from None


def to_json(config: Config) -> bytes:
    return msgspec.json.encode(config)


def from_json(data: bytes) -> Config:
    return msgspec.json.decode(data, type=Config)
