"""Workers start with the allocator and OpenMP runtime preloaded where they are installed
(runtime/preload.py), OMNIFLOW_PRELOAD=0 turns that off, and a machine without them runs
the workers as before."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import omniflow
from omniflow.runtime import preload
from omniflow.runtime.config import parse
from tests.helpers import echo_config, expected_echo


def worker_maps(name: str) -> list[str]:
    """Each worker's /proc/PID/maps, read while a request goes through the deployment."""

    async def main():
        async with omniflow.Runtime(echo_config(name=name)) as rt:
            outs, _ = await rt.call({"text": "preloaded"})
            assert [out.data["text"] for out in outs] == expected_echo("preloaded")
            return [Path(f"/proc/{r.proc.pid}/maps").read_text() for r in rt.supervisor.replicas]

    return asyncio.run(main())


@pytest.fixture
def stand_ins(tmp_path, monkeypatch) -> dict[str, Path]:
    """Two real shared libraries under the names preload looks for, in a folder of their
    own on OMNIFLOW_PRELOAD_DIRS (the machine's own copies may be absent)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build stand-in libraries")
    source = tmp_path / "stand_in.c"
    source.write_text("int omniflow_preload_stand_in(void) { return 1; }\n")
    folder = tmp_path / "libs"
    folder.mkdir()
    paths = {}
    for name, files in preload.LIBRARIES.items():
        paths[name] = folder / files[0]
        subprocess.run(
            [compiler, "-shared", "-fPIC", str(source), "-o", str(paths[name])], check=True
        )
    monkeypatch.setenv(preload.DIRS, str(folder))
    return paths


def test_workers_start_with_the_libraries_preloaded_unless_switched_off(
    run_root, stand_ins, monkeypatch
):
    monkeypatch.delenv(preload.SWITCH, raising=False)
    for maps in worker_maps("preload-on"):
        assert all(str(path) in maps for path in stand_ins.values())
    monkeypatch.setenv(preload.SWITCH, "tcmalloc")
    for maps in worker_maps("preload-one"):
        assert str(stand_ins["tcmalloc"]) in maps and str(stand_ins["iomp"]) not in maps
    monkeypatch.setenv(preload.SWITCH, "0")
    for maps in worker_maps("preload-off"):
        assert not any(str(path) in maps for path in stand_ins.values())


def test_the_machines_own_libraries_are_found_and_loaded(run_root, monkeypatch):
    """Where setup installed them (Debian's libtcmalloc-minimal4, pip's intel-openmp), the
    supervisor finds them on its own and the workers load them."""
    monkeypatch.delenv(preload.SWITCH, raising=False)
    monkeypatch.delenv(preload.DIRS, raising=False)
    found = preload.find(list(preload.LIBRARIES), preload.search_dirs())
    if not found:
        pytest.skip("neither tcmalloc nor Intel OpenMP is installed here")
    for maps in worker_maps("preload-own"):
        assert all(path in maps for path in found), found


def test_without_the_libraries_the_environment_is_left_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(preload, "search_dirs", lambda env: [tmp_path])  # an empty folder
    env = {"LD_PRELOAD": "/opt/mine.so", "PATH": "/bin"}
    assert preload.worker_env(env) == env


def test_preload_keeps_what_ld_preload_held_and_sets_intel_openmps_spin(stand_ins):
    dirs = {preload.DIRS: str(stand_ins["iomp"].parent)}
    env = preload.worker_env({**dirs, "LD_PRELOAD": f"/opt/mine.so {stand_ins['tcmalloc']}"})
    paths = [str(stand_ins["tcmalloc"]), str(stand_ins["iomp"]), "/opt/mine.so"]
    assert env["LD_PRELOAD"].split() == paths  # once each, ours first
    assert env["KMP_BLOCKTIME"] == preload.KMP_BLOCKTIME_MS
    assert preload.worker_env({**dirs, "KMP_BLOCKTIME": "50"})["KMP_BLOCKTIME"] == "50"


def test_a_bad_switch_value_names_the_variable():
    with pytest.raises(ValueError, match="OMNIFLOW_PRELOAD='jemalloc': unknown jemalloc"):
        preload.worker_env({preload.SWITCH: "jemalloc"})


def test_a_killed_workers_intel_openmp_registration_is_removed(run_root, monkeypatch):
    """Intel OpenMP registers each process in /dev/shm and removes it on a normal exit only:
    the supervisor removes a killed worker's when it reaps it."""
    if not preload.find(["iomp"], preload.search_dirs()):
        pytest.skip("Intel OpenMP (pip's intel-openmp, which setup installs) is not installed")
    monkeypatch.setenv(preload.SWITCH, "iomp")

    def registration(pid: int) -> Path:
        return Path(f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}")

    config = parse(
        {
            "name": "kmp",
            "roles": {"sums": {"actor": "tests.graph_roles:SumsInParallel"}},
            "graph": {"edges": [{"from": "input", "to": "sums"}]},
            "runtime": {"heartbeat_s": 0.2, "ttl_s": 1.0, "restart_backoff_s": 0.1},
        },
        "<test>",
    )

    async def main():
        async with omniflow.Runtime(config) as rt:
            _, result = await rt.call({"x": 1})
            victim = rt.supervisor.replicas[0]
            old = victim.proc.pid
            assert registration(old).exists()  # its OpenMP runtime registered itself
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while victim.proc.pid == old or victim.state != "ready":
                assert time.monotonic() < deadline, "the worker did not come back"
                await asyncio.sleep(0.05)
            await rt.call({"x": 2})
            return old, victim.proc.pid

    old, new = asyncio.run(main())
    assert not registration(old).exists()
    assert not registration(new).exists()  # it exited normally with the deployment
