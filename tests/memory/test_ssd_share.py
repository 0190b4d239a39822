"""``cache.ssd_capacity`` is one total per host (issue #40 item 11): the processes sharing
an SSD folder (encoder caches, the llm's KV pages) preallocate together at most the
capacity, each at most its fair part (capacity // the deployment's sharers on the host)
whatever order they start in; a dead process's files stop counting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from omniflow.memory import unlink_pool
from omniflow.memory.ssd_share import held_by_live
from omniflow.roles.options import ssd_sharers
from omniflow.runtime.config import Config

PAGE = 64 << 10
CAPACITY = 100 * PAGE
ENTRIES = 4  # an encoder cache asks for its bytes in pages plus 2 pages per entry
ROOT = Path(__file__).resolve().parents[2]

# One encoder process: its own page pool, its cache's SSD tier in the shared folder. Once
# told to start (a line on stdin) it makes its cache, says what it preallocated, then holds
# it until told to go (another line).
ENCODER = """
import json, os, sys
from omniflow.memory import CacheConfig, PagePool, unlink_pool
from omniflow.roles.encoder_cache import EncoderOutputCache

ssd_dir, replica, sharers, want = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
name = f"omniflow-share-{os.getpid()}"
pool = PagePool.create(name, 16 * {page}, page_size={page})
config = CacheConfig(page_size={page}, ssd_dir=ssd_dir, ssd_capacity={capacity})
sys.stdin.readline()
cache = EncoderOutputCache(
    {entries}, (want - 2 * {entries}) * {page}, pool, config, f"encoder-e-{replica}", sharers
)
print(json.dumps({"ssd": cache._ssd.slots * {page} if cache._ssd else 0}), flush=True)
sys.stdin.readline()
cache.close()
pool.close()
unlink_pool(name)
"""
for key, value in {"page": PAGE, "capacity": CAPACITY, "entries": ENTRIES}.items():
    ENCODER = ENCODER.replace("{" + key + "}", str(value))


def _spawn(script: str, *args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _encoder(ssd: Path, replica: int, sharers: int, want_pages: int) -> subprocess.Popen:
    return _spawn(ENCODER, ssd, replica, sharers, want_pages)


def _say(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def _share(proc: subprocess.Popen) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"process {proc.pid} exited ({proc.wait()})"
    return json.loads(line)["ssd"]


def _on_disk(ssd: Path) -> int:
    return sum(p.stat().st_size for p in ssd.glob("*.pages"))


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            assert p.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it exited meanwhile
                p.stdin.write("\n\n")  # one not told to start yet makes its cache, then goes
                p.stdin.close()
    for p in procs:
        p.wait(30)
        unlink_pool(f"omniflow-share-{p.pid}")  # a killed one's is left in /dev/shm


def test_encoders_wanting_more_than_the_capacity_each_get_a_fair_part(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # Three sharers, each wanting 60 of the 100 pages: first come, first served gave the
    # first 60, the next 40 and the last nothing. Each may take 100 // 3 bytes: 33 pages.
    first = [_encoder(ssd, i, 3, 60) for i in range(3)]
    late = _encoder(ssd, 9, 3, 60)  # it starts below
    procs = [*first, late]
    try:
        for p in first:
            _say(p)  # all at once: the folder's lock orders them
        shares = [_share(p) for p in first]
        assert shares == [33 * PAGE] * 3, shares
        assert _on_disk(ssd) == held_by_live(ssd) == 99 * PAGE
        # A killed one's files stay on disk but stop counting: a newcomer takes its part.
        victim = first[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        _say(late)
        assert _share(late) == 33 * PAGE
        assert held_by_live(ssd) == 99 * PAGE
    finally:
        _end(procs)
    killed = {f.name for f in ssd.iterdir()}
    assert all(f"-{victim.pid}." in name for name in killed), killed  # only the killed one's


def test_the_sharers_are_this_hosts_replicas_with_an_ssd_tier(tmp_path):
    encoder = "omniflow.roles.vision_encoder:VisionEncoderRole"
    model = {"model_path": str(tmp_path), "build_tiny": True}
    raw = {
        "name": "count",
        "roles": {
            "vision": {"actor": encoder, "replicas": 3, "options": model},
            "uncached": {"actor": encoder, "options": {**model, "cache_entries": 0}},
            "llm": {"actor": "omniflow.roles.llm:LLMRole", "replicas": 2, "options": model},
            "llm_ssd": {
                "actor": "omniflow.roles.llm:LLMRole",
                "replicas": 2,
                "options": {**model, "host_kv_mb": 1, "ssd_kv_mb": 1},
            },
            "upper": {"actor": "omniflow.roles.echo:Upper"},
        },
        "graph": {"edges": [{"from": "input", "to": "upper"}]},
        "cache": {"ssd_dir": str(tmp_path), "ssd_capacity": "1MiB"},
        "runtime": {"host_id": "here"},
    }
    assert ssd_sharers(msgspec.convert(raw, Config)) == 3 + 2
    raw["hosts"] = {"here": {"roles": ["llm_ssd", "upper"]}, "there": {"roles": ["vision"]}}
    assert ssd_sharers(msgspec.convert(raw, Config)) == 2
    del raw["cache"]
    assert ssd_sharers(msgspec.convert(raw, Config)) == 0
