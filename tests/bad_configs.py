"""A valid config and bad variants of it, each with the error it must give at load.

Shared by tests/runtime/test_config.py (``config.load``) and tests/cli (``omniflow up``).
Loading never builds a model, so the relative model_path needs no folder with build_tiny.
"""

from __future__ import annotations

from pathlib import Path

GOOD = """\
name = "bad"

[roles.upper]
actor = "omniflow.roles.echo:Upper"
options = { delay_ms = 1 }

[roles.llm]
actor = "omniflow.roles.llm:LLMRole"
replicas = 1

[roles.llm.options]
model_path = "models/llm"
build_tiny = true
kv_cache_mb = 8

[graph]
edges = [{ from = "input", to = "upper" }, { from = "upper", to = "llm" }]

[runtime]
heartbeat_s = 0.5

[cache]
host_pool = "64MiB"
"""

# (id, text replaced in GOOD, replacement, the message after "FILE: ")
CASES = [
    (
        "misspelled-option",
        "kv_cache_mb = 8",
        "kv_cache_mb = 8\nhidden_sise = 32",
        "[roles.llm.options] hidden_sise: unknown option (did you mean hidden_size?)",
    ),
    (
        "wrong-type",
        "kv_cache_mb = 8",
        'kv_cache_mb = "8"',
        '[roles.llm.options] kv_cache_mb = "8": expected int, got str',
    ),
    (
        "out-of-range",
        "kv_cache_mb = 8",
        "kv_cache_mb = 0",
        "[roles.llm.options] kv_cache_mb = 0: expected int >= 1",
    ),
    (
        "not-a-choice",
        "kv_cache_mb = 8",
        'dtype = "int3"',
        '[roles.llm.options] dtype: "int3" is not one of',
    ),
    (
        "model-path-does-not-exist",
        "build_tiny = true",
        "",
        "[roles.llm.options] model_path: models/llm (",  # then the absolute path
    ),
    (
        "model-path-absent",
        'model_path = "models/llm"',
        "",
        "[roles.llm.options] model_path: missing (a required option)",
    ),
    (
        "echo-option",
        "delay_ms = 1",
        "delay = 1",
        "[roles.upper.options] delay: unknown option (did you mean delay_ms?)",
    ),
    (
        "role-field-range",
        "replicas = 1",
        "replicas = 0",
        "[roles.llm] replicas = 0: expected int >= 1",
    ),
    (
        "runtime-range",
        "heartbeat_s = 0.5",
        "heartbeat_s = -1",
        "[runtime] heartbeat_s = -1: expected float > 0",
    ),
    (
        "cache-unknown-field",
        'host_pool = "64MiB"',
        'host_pol = "64MiB"',
        "[cache] host_pol: unknown field (did you mean host_pool?)",
    ),
    (
        "actor-not-found",
        "omniflow.roles.echo:Upper",
        "omniflow.roles.echo:Uper",
        '[roles.upper] actor = "omniflow.roles.echo:Uper": cannot load: '
        "module omniflow.roles.echo has no Uper",
    ),
    (
        "gateway-port-out-of-range",
        "[runtime]\n",
        "[gateway]\nport = 70000\n\n[runtime]\n",
        "[gateway] port = 70000: expected int <= 65535",
    ),
    (
        "gateway-unknown-field",
        "[runtime]\n",
        "[gateway]\nprot = 8000\n\n[runtime]\n",
        "[gateway] prot: unknown field (did you mean port?)",
    ),
    (
        "gateway-role-name-taken",
        "[roles.llm]\n",
        '[gateway]\n\n[roles.gateway]\nactor = "omniflow.roles.echo:Upper"\n\n[roles.llm]\n',
        "[roles.gateway]: the name is [gateway]'s",
    ),
]


def write(folder: Path, old: str, new: str) -> Path:
    assert old in GOOD
    path = folder / "bad.toml"
    path.write_text(GOOD.replace(old, new))
    return path
