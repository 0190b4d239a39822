"""``cache.ssd_capacity`` is one total per host (issue #40 item 11): encoder processes
sharing an SSD folder preallocate together at most the capacity, each what its cache can
use while the total allows; a dead process's files stop counting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from omniflow.memory import unlink_pool

PAGE = 64 << 10
CAPACITY = 100 * PAGE
# Each cache asks for 40 pages (32 of entries' bytes, 2 per entry for 4 entries).
WANT = 40 * PAGE

# One encoder process: its own page pool, its cache's SSD tier in the shared folder. It says
# what it preallocated, then holds it until told to go (a line on stdin).
ENCODER = """
import json, os, sys
from omniflow.memory import CacheConfig, PagePool, unlink_pool
from omniflow.roles.encoder_cache import EncoderOutputCache

ssd_dir, replica = sys.argv[1], sys.argv[2]
name = f"omniflow-share-{os.getpid()}"
pool = PagePool.create(name, 16 * {page}, page_size={page})
config = CacheConfig(page_size={page}, ssd_dir=ssd_dir, ssd_capacity={capacity})
cache = EncoderOutputCache(4, 32 * {page}, pool, config, name=f"encoder-e-{replica}")
print(json.dumps({"ssd": cache._ssd.slots * {page} if cache._ssd else 0}), flush=True)
sys.stdin.readline()
cache.close()
pool.close()
unlink_pool(name)
""".replace("{page}", str(PAGE)).replace("{capacity}", str(CAPACITY))


def _start(ssd: Path, replica: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", ENCODER, str(ssd), str(replica)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _share(proc: subprocess.Popen) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"encoder {proc.pid} exited ({proc.wait()})"
    return json.loads(line)["ssd"]


def _on_disk(ssd: Path) -> int:
    return sum(p.stat().st_size for p in ssd.glob("*.pages"))


def test_encoder_processes_together_preallocate_at_most_the_capacity(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    procs = [_start(ssd, i) for i in range(3)]  # all at once: the folder's lock orders them
    try:
        shares = sorted(_share(p) for p in procs)
        assert shares == [20 * PAGE, WANT, WANT], shares  # the last one gets what is left
        assert _on_disk(ssd) == sum(shares) == CAPACITY
        # A killed one's files stay on disk but stop counting: a newcomer takes its share.
        victim = next(p for p in procs if len(list(ssd.glob(f"*-{p.pid}.*.pages"))))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        late = _start(ssd, 9)
        procs.append(late)
        assert _share(late) > 0
        live = sum(
            f.stat().st_size for p in procs if p.poll() is None for f in ssd.glob(f"*-{p.pid}.*")
        )
        assert live <= CAPACITY
    finally:
        for p in procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
        for p in procs:
            p.wait(30)
            unlink_pool(f"omniflow-share-{p.pid}")  # the killed one's is left in /dev/shm
    killed = {f.name for f in ssd.iterdir()}
    assert all(f"-{victim.pid}." in name for name in killed), killed  # only the killed one's
