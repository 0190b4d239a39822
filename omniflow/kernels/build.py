"""The build of omniflow's CPU kernels: every .c file in this folder, compiled with the
machine's compiler (`$CC`, else cc/gcc/clang) into one shared library in a per-user cache,
keyed by the content of every source file, the flags, the compiler and the CPU's flags.
`build()` raises Unavailable, with the reason, where that cannot work (cpu.py loads it).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# The kernels' shared header; the library is built from every .c file beside it.
SOURCE = Path(__file__).with_name("cpu_kernels.h")
# -ffast-math's parts, not the flag: with -ffast-math (or -funsafe-math-optimizations) GCC
# links crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for
# the whole process that loads the library (torch and every Python float included).
FAST_MATH = [
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-ffinite-math-only",
    "-fno-rounding-math",
    "-fcx-limited-range",
]
FLAGS = ["-O3", "-march=native", "-fopenmp", *FAST_MATH, "-shared", "-fPIC"]
ENV_SWITCH = "OMNIFLOW_CPU_KERNELS"


class Unavailable(Exception):
    pass


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise Unavailable("no C compiler (set CC, or install gcc)")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omniflow" / "kernels"


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def build() -> Path:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise Unavailable(f"{ENV_SWITCH}=0")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(
            f"built for x86-64 Linux only, not {platform.system()} {platform.machine()}"
        )
    compiler = _compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise Unavailable(f"{compiler} --version failed: {error}") from error
    sources = sorted(SOURCE.parent.glob("*.c"))
    # Every file a build reads, headers included; -march=native: the build is only good for
    # CPUs with these features.
    key = hashlib.sha256(b"\0".join([" ".join(FLAGS).encode(), version.encode(), _cpu_flags()]))
    for path in sorted([*sources, *SOURCE.parent.glob("*.h")]):
        key.update(b"\0%s\0%s" % (path.name.encode(), path.read_bytes()))
    target = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never load a half file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, *map(str, sources), "-o", str(built), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise Unavailable(f"{' '.join(command)}: {error}") from error
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(command)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target
