"""Shared helpers for the benchmarks: percentiles, short run dirs, JSON output."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def scratch_dir(prefix: str, parent: str | None = None) -> Path:
    """A temporary directory that goes when the benchmark exits: the models and run dirs a
    run writes (100+ MB) would otherwise pile up in /tmp, run after run."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def short_run_root() -> Path:
    root = scratch_dir("ofb-", parent="/tmp")  # short: ipc:// paths must fit in 107 bytes
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    return root


def emit(result: dict) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(result, sort_keys=False), flush=True)


def have_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def tree_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) each process of this run has used so far: this one as
    ``client``, each omniflow worker under it by ``role/replica``. From /proc (Linux); a
    difference of two readings is what the work between them cost, however noisy the
    host's clock speed or neighbours make the latencies."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid: (parent, CPU seconds), one read each
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    mine, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, (parent, _) in stats.items() if parent in mine} - mine
        mine |= more
        grew = bool(more)
    out: dict[str, float] = {}
    for pid in mine & stats.keys():
        if pid == os.getpid():
            out["client"] = stats[pid][1]
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "omniflow.runtime.worker" in argv and len(argv) >= 5:  # not the supervisor's helpers
            out[f"{argv[-3]}/{argv[-2]}"] = stats[pid][1]
    return out


def cpu_name() -> str:
    """The CPU model and how many cores this process may use: every benchmark prints it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({cores} cores)"
    except OSError:
        pass
    import platform

    return f"{platform.processor() or platform.machine()} ({cores} cores)"
