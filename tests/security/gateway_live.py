"""A real deployment of the echo pipeline with its HTTP gateway (a worker process), for
the hostile HTTP tests and benchmarks/fuzz.py's connection phase."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from omniflow.runtime.config import parse
from tests.security.live import LiveDeployment

KEY = "sk-hardening"


def gateway_config(name: str, **gateway: Any) -> Any:
    return parse(
        {
            "name": name,
            "roles": {
                "upper": {"actor": "omniflow.roles.echo:Upper"},
                "reverse": {"actor": "omniflow.roles.echo:Reverse"},
            },
            "graph": {
                "edges": [{"from": "input", "to": "upper"}, {"from": "upper", "to": "reverse"}]
            },
            "runtime": {"heartbeat_s": 0.5, "ttl_s": 10.0, "drain_timeout_s": 2.0},
            "gateway": {"port": 0, "api_key": KEY, **gateway},
        }
    )


class LiveGateway(LiveDeployment):
    """The deployment, and where its gateway listens."""

    def __init__(self, name: str, **gateway: Any) -> None:
        super().__init__(gateway_config(name, **gateway), role="gateway")
        url_file = Path(self.rt.supervisor.run_dir) / "gateway.url"
        until = time.monotonic() + 60
        while not url_file.exists():
            assert time.monotonic() < until, "the gateway wrote no gateway.url"
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        host, _, port = self.url.removeprefix("http://").rpartition(":")
        self.host, self.port = host, int(port)
        self.name = name

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(status, JSON body or {}, headers) of one request on a fresh connection; JSON
        bodies with the key and a JSON content type unless ``headers`` says otherwise."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        sent = {"Authorization": f"Bearer {KEY}"}
        data = body
        if body is not None and not isinstance(body, bytes):
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        sent.update(headers or {})
        try:
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                parsed = json.loads(raw) if raw else {}
            except ValueError:
                parsed = {"raw": raw[:200].decode("utf-8", "replace")}
            return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def chat(self, text: str = "hello", **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": self.name, "messages": [{"role": "user", "content": text}], **extra}
        status, parsed, _ = self.request("POST", "/v1/chat/completions", body)
        return status, parsed
