"""Discovery: where actors register and find each other."""

from omniflow.control.discovery.base import (
    Registry,
    RegistryError,
    WatchEvent,
    actor_key,
    actors_prefix,
    decode_record,
    encode_record,
    list_actors,
)
from omniflow.control.discovery.embedded import EmbeddedRegistry, EmbeddedRegistryServer
from omniflow.control.discovery.view import RegistryView

__all__ = [
    "EmbeddedRegistry",
    "EmbeddedRegistryServer",
    "Registry",
    "RegistryError",
    "RegistryView",
    "WatchEvent",
    "actor_key",
    "actors_prefix",
    "decode_record",
    "encode_record",
    "list_actors",
    "open_registry",
]


def open_registry(address: str) -> Registry:
    """A client for ``etcd://host:port`` or an embedded registry's ZeroMQ address."""
    if address.startswith("etcd://"):
        from omniflow.control.discovery.etcd import EtcdRegistry

        return EtcdRegistry.from_url(address)
    return EmbeddedRegistry(address)
