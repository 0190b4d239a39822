"""``cache.ssd_capacity`` is one total per host (issue #40 item 11): the processes sharing
an SSD folder (encoder caches, the llm's KV pages) preallocate together at most the
capacity, each at most its fair part (capacity // the deployment's sharers on the host)
whatever order they start in; a dead process's files stop counting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from omniflow.memory import CacheConfig, PagePool, unlink_pool
from omniflow.memory.ssd_share import SHARE_PREFIX, held_by_live
from omniflow.roles.ssd_sharers import ssd_sharers
from omniflow.runtime.config import Config, parse

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

# One llm replica as its worker makes it (a pool, the deployment's [cache], the run dir in
# OMNIFLOW_RUN_DIR), with host_kv_mb and ssd_kv_mb: it says what its KV tier preallocated.
LLM = """
import asyncio, json, os, sys
from omniflow.memory import CacheConfig, PagePool, unlink_pool
from omniflow.roles.llm import LLMRole

ssd_dir, model = sys.argv[1], sys.argv[2]
name = f"omniflow-share-{os.getpid()}"
pool = PagePool.create(name, 64 * {page}, page_size={page})
role = LLMRole("llm", 0, {"model_path": model, **{options}})
role.use_pool(pool, CacheConfig(page_size={page}, ssd_dir=ssd_dir, ssd_capacity={capacity}))
asyncio.run(role.setup())
ssd = role.llm.tiers.ssd
print(json.dumps({"ssd": ssd.slots * {page} if ssd else 0}), flush=True)
sys.stdin.readline()
asyncio.run(role.close())
pool.close()
unlink_pool(name)
"""
# ssd_kv_mb 4: 64 pages, more than its fair part of 100 between two.
LLM_OPTIONS = {"build_tiny": True, "threads": 1, "kv_cache_mb": 1, "host_kv_mb": 1, "ssd_kv_mb": 4}
for key, value in {"page": PAGE, "capacity": CAPACITY, "options": LLM_OPTIONS}.items():
    LLM = LLM.replace("{" + key + "}", str(value))


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


def _deployment(ssd: Path, models: Path) -> Config:
    """An llm with an SSD KV tier and a vision encoder (with its cache) on one host: two
    sharers of cache.ssd_capacity."""
    vision = {"model_path": str(models / "vision"), "build_tiny": True}
    raw = {
        "name": "ssdshare",
        "roles": {
            "vision_encoder": {
                "actor": "omniflow.roles.vision_encoder:VisionEncoderRole",
                "options": vision,
            },
            "llm": {
                "actor": "omniflow.roles.llm:LLMRole",
                "options": {"model_path": str(models / "llm"), **LLM_OPTIONS},
            },
        },
        "graph": {
            "edges": [
                {"from": "input", "to": "vision_encoder"},
                {"from": "vision_encoder", "to": "llm"},
            ]
        },
        "cache": {"page_size": PAGE, "ssd_dir": str(ssd), "ssd_capacity": CAPACITY},
    }
    return parse(raw, "<test>")


def test_the_llm_kv_tier_takes_its_share_and_is_counted(tmp_path, monkeypatch, caplog):
    ssd, models, run_dir = tmp_path / "ssd", tmp_path / "models", tmp_path / "run"
    for folder in (ssd, models, run_dir):
        folder.mkdir()
    config = _deployment(ssd, models)
    assert ssd_sharers(config) == 2
    (run_dir / "deployment.json").write_bytes(msgspec.json.encode(config))
    llm = _spawn(LLM, ssd, models / "llm", env={"OMNIFLOW_RUN_DIR": str(run_dir)})
    # An encoder counted as alone (another deployment's, say) wants 60 pages.
    encoder = _encoder(ssd, 0, 1, 60)
    procs = [llm, encoder]
    try:
        # The llm wants 64 pages and takes its fair part, 50, in a file the share counts.
        assert _share(llm) == 50 * PAGE
        (kv_file,) = ssd.glob(f"{SHARE_PREFIX}kv-llm-0-{llm.pid}.0.pages")
        assert kv_file.stat().st_size == held_by_live(ssd) == 50 * PAGE
        _say(encoder)
        assert _share(encoder) == 50 * PAGE  # what the llm's file leaves, not its 60
        assert _on_disk(ssd) == held_by_live(ssd) == CAPACITY
        # Another llm replica finds the capacity spent: no SSD KV tier, and a warning.
        monkeypatch.setenv("OMNIFLOW_RUN_DIR", str(run_dir))
        assert _spent_llm_replica(ssd, models / "llm", caplog) is None
        assert _on_disk(ssd) == CAPACITY
    finally:
        _end(procs)
    assert not list(ssd.iterdir())  # each closed removed its files


def _spent_llm_replica(ssd: Path, model: Path, caplog) -> object:
    from omniflow.roles.llm import LLMRole

    name = f"omniflow-share-{os.getpid()}"
    pool = PagePool.create(name, 64 * PAGE, page_size=PAGE)
    role = LLMRole("llm", 1, {"model_path": str(model), **LLM_OPTIONS})
    role.use_pool(pool, CacheConfig(page_size=PAGE, ssd_dir=str(ssd), ssd_capacity=CAPACITY))
    try:
        with caplog.at_level(logging.WARNING, logger="omniflow.roles.llm"):
            asyncio.run(role.setup())
        assert role.llm.tiers is not None
        (record,) = [r for r in caplog.records if "no SSD KV tier" in r.getMessage()]
        assert "role llm replica 1" in record.getMessage()
        assert f"{CAPACITY} bytes in {ssd}" in record.getMessage()
        return role.llm.tiers.ssd
    finally:
        asyncio.run(role.close())
        pool.close()
        unlink_pool(name)


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


def test_a_replicas_dead_files_go_old_names_too(tmp_path):
    """Files a killed earlier process of the same role replica left are removed, with the
    share prefix or without (the names before it); a live process's files stay."""
    from omniflow.memory.ssd_share import SHARE_PREFIX, remove_orphans

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone now
    name = "encoder-vision-0"
    files = {
        "dead": tmp_path / f"{SHARE_PREFIX}{name}-{dead.pid}.0.pages",
        "dead_old_name": tmp_path / f"{name}-{dead.pid}.0.pages",
        "live": tmp_path / f"{SHARE_PREFIX}{name}-{os.getpid()}.0.pages",
        "other_replica": tmp_path / f"{SHARE_PREFIX}encoder-vision-1-{dead.pid}.0.pages",
    }
    for path in files.values():
        path.write_bytes(b"x")
    remove_orphans(tmp_path, name)
    assert {k for k, path in files.items() if path.exists()} == {"live", "other_replica"}
