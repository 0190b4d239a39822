"""The allocator and OpenMP runtime that worker processes load first (LD_PRELOAD).

A worker's engine allocates and frees tensors of a few MB on every step, and runs its
kernels in OpenMP regions many times a step. glibc's malloc hands large blocks back to the
OS (and faults fresh pages in) on every step, and libgomp, the OpenMP runtime torch links,
wakes its threads slower than Intel's. tcmalloc (Debian's libtcmalloc-minimal4) keeps
freed memory for reuse; Intel OpenMP (libiomp5, pip's intel-openmp) serves the GOMP_* calls
of torch and of omniflow's kernels in its place. Both are what vLLM's CPU build asks for.
scripts/setup.sh installs them; the supervisor preloads whichever is found into every
worker it spawns (`worker_env`), and a worker runs as before where neither is installed.

OMNIFLOW_PRELOAD=0 turns this off; a list of names ("tcmalloc", "iomp") preloads only those.
OMNIFLOW_PRELOAD_DIRS (folders, colon-separated) is searched first. An LD_PRELOAD already
set is kept, after these.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from pathlib import Path

SWITCH = "OMNIFLOW_PRELOAD"
DIRS = "OMNIFLOW_PRELOAD_DIRS"
# Per library, the file names to look for, in order.
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "iomp": ("libiomp5.so",),
}
# Intel OpenMP waits this long (ms) for more work after a parallel region, spinning, unless
# told otherwise: 200 by default, which keeps a core busy between a step's kernels and
# takes it from every other process on a small machine.
KMP_BLOCKTIME_MS = "1"


def search_dirs(env: dict[str, str] | os._Environ[str] = os.environ) -> list[Path]:
    """Where the libraries are looked for: OMNIFLOW_PRELOAD_DIRS, this interpreter's
    environment's lib (where pip puts intel-openmp's), then the system's library folders."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    dirs = [Path(folder) for folder in env.get(DIRS, "").split(os.pathsep) if folder]
    dirs += [Path(sys.prefix) / "lib", Path(f"/usr/lib/{multiarch}"), Path("/usr/lib64")]
    return dirs + [Path("/usr/lib"), Path("/usr/local/lib")]


def wanted(env: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """The names OMNIFLOW_PRELOAD asks for (all by default, none for 0/off/false/empty)."""
    value = env.get(SWITCH, "1").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return list(LIBRARIES)
    if value in ("0", "off", "false", "no", ""):
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in LIBRARIES]
    if unknown:
        raise ValueError(
            f"{SWITCH}={value!r}: unknown {', '.join(unknown)}; "
            f"0, 1 or a list of {', '.join(LIBRARIES)}"
        )
    return names


def find(names: list[str], dirs: list[Path]) -> list[str]:
    """The path of each named library found in dirs (the first file that exists), in order."""
    found = []
    for name in names:
        for folder in dirs:
            path = next((folder / f for f in LIBRARIES[name] if (folder / f).is_file()), None)
            if path is not None:
                found.append(str(path))
                break
    return found


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """env with the libraries its OMNIFLOW_PRELOAD asks for (and are found) in LD_PRELOAD,
    ahead of what it held; Intel OpenMP's spin after a region cut to KMP_BLOCKTIME_MS and
    tcmalloc's large-allocation reports off, unless set."""
    paths = find(wanted(env), search_dirs(env))
    if not paths:
        return env
    out = dict(env)
    kept = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p not in paths]
    out["LD_PRELOAD"] = " ".join(paths + kept)
    if any(Path(p).name.startswith("libiomp") for p in paths):
        out.setdefault("KMP_BLOCKTIME", KMP_BLOCKTIME_MS)
    if any(Path(p).name.startswith("libtcmalloc") for p in paths):
        # tcmalloc reports every allocation over 1 GB on stderr (a KV cache is one).
        out.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return out


def forget(pid: int) -> None:
    """Remove what Intel OpenMP registered for ``pid``, which has exited: each process that
    loads it makes ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>`` (or a file of that name in
    /tmp) and removes it only on a normal exit, so every worker killed with -9 would leave one
    behind. The supervisor calls this when it reaps a worker."""
    name = f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"
    for folder in ("/dev/shm", "/tmp"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
