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
