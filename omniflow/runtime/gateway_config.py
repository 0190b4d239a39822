"""``[gateway]``: the HTTP front's address, key, CORS and Host rules, and its limits
(omniflow/roles/gateway/limits.py). Re-exported by omniflow.runtime.config."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """[gateway]: an OpenAI-compatible HTTP front, run as one more role outside the graph."""

    host: Annotated[str, Meta(description="address the HTTP server binds")] = "127.0.0.1"
    port: Annotated[
        int, Meta(ge=0, le=65535, description="0: any free port (`omniflow up --port`)")
    ] = 8000
    api_key: Annotated[str, Meta(description="when set, requests need this Bearer key")] = ""
    max_body_mb: Annotated[float, Meta(gt=0, description="larger request bodies get 413")] = 32.0
    allow_local_paths: Annotated[
        bool, Meta(description="image_url / input_audio may name a local file")
    ] = False
    max_inflight: Annotated[
        int, Meta(ge=1, description="requests in flight at once; more get 429")
    ] = 256
    timeout_s: Annotated[
        float, Meta(ge=0, description="deadline of one HTTP request (0: [runtime]'s)")
    ] = 0.0
    cors_origins: Annotated[
        list[str], Meta(description="origins browsers may call from (CORS); none: CORS off")
    ] = msgspec.field(default_factory=list)
    allowed_hosts: Annotated[
        list[str],
        Meta(description='Host headers served besides loopback names and host ("*": any)'),
    ] = msgspec.field(default_factory=list)
    max_connections: Annotated[
        int, Meta(ge=1, description="open HTTP connections; more get 503 (capped by the fd limit)")
    ] = 1000
    keepalive_timeout_s: Annotated[
        int, Meta(ge=1, description="an idle kept-alive connection closes after this")
    ] = 5
    header_timeout_s: Annotated[
        float, Meta(gt=0, description="a request's head must arrive within this (else 408)")
    ] = 10.0
    max_header_kb: Annotated[float, Meta(gt=0, description="a larger request head gets 431")] = 64.0
    body_timeout_s: Annotated[
        float, Meta(gt=0, description="a request's body must arrive within this (else 408)")
    ] = 60.0
    max_body_reads: Annotated[int, Meta(ge=1, description="bodies read at once; more get 503")] = 64
    body_memory_mb: Annotated[
        float, Meta(gt=0, description="bodies held while they arrive, all together; past: 503")
    ] = 512.0
    max_id_chars: Annotated[
        int, Meta(ge=1, description="longest session or user id (the llm keeps sessions)")
    ] = 256

    def __post_init__(self) -> None:
        if self.body_memory_mb < self.max_body_mb:
            raise ValueError(
                f"gateway.body_memory_mb: {self.body_memory_mb} is less than max_body_mb "
                f"({self.max_body_mb}): no body of the largest size could be read"
            )
