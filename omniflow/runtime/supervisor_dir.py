"""The supervisor's run dir: where it is, the lock that makes one supervisor its owner,
the checks before a start, the state file ``omniflow status`` and ``down`` read, and what
a stop removes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from omniflow.memory import pid_alive
from omniflow.runtime.config import Config, to_json
from omniflow.runtime.hosts import is_multi_host
from omniflow.runtime.replica import StartError
from omniflow.runtime.rundir import default_run_root, run_root, run_root_of
from omniflow.transport.endpoint import private_dir


def default_run_dir(name: str, host_id: str = "") -> Path:
    """RUN_ROOT/NAME, or RUN_ROOT/NAME@HOST for one host's share of a multi-host deployment
    (network namespaces, containers sharing /tmp: each host holds its own run dir's lock)."""
    return run_root() / (f"{name}@{host_id}" if host_id else name)


def run_dir_for(config: Config) -> Path:
    if config.runtime.run_dir:
        return Path(config.runtime.run_dir)
    return default_run_dir(config.name, config.runtime.host_id if is_multi_host(config) else "")


def make_run_dir(run_dir: Path) -> None:
    """Make ``run_dir`` (and a missing run root) 0700, after checking every folder from the
    run root down is ours and writable by no one else (``UntrustedPath`` names one that
    is not)."""
    root = run_root_of(run_dir)
    private_dir(run_dir, root)
    if root == default_run_root():
        # omniflow's own name: others may not even list the deployments in it (one made
        # 0755 before is narrowed too); a root the user chose is only checked.
        os.chmod(root, 0o700)


def lock_run_dir(run_dir: Path, name: str) -> int:
    """Take the run dir's lock (the descriptor that holds it) for the supervisor's life: a
    second start of the same deployment fails here, before it can touch the first one's
    sockets, pool or state."""
    make_run_dir(run_dir)
    fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartError(
            f"deployment {name!r} is already running or starting "
            f"(run dir {run_dir}); stop it with `omniflow down`"
        ) from None
    return fd


def check_run_dir(run_dir: Path, config: Config) -> None:
    """No live supervisor named in its state file; the folders made; socket paths that
    fit; the config written for the workers to read."""
    state_path = run_dir / "state.json"
    if state_path.exists():
        state = json.loads(state_path.read_text())
        if pid_alive(state.get("pid", 0)):
            raise StartError(
                f"deployment {config.name!r} is already running (pid {state['pid']}, "
                f"run dir {run_dir}); stop it with `omniflow down`"
            )
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (run_dir / "logs").mkdir(exist_ok=True)
    if len(f"ipc://{run_dir}/") + 40 > 107:
        raise StartError(f"run dir {run_dir} is too long for ipc:// socket paths")
    (run_dir / "deployment.json").write_bytes(to_json(config))


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    """state.json, replaced whole: a reader never sees half of it."""
    path = run_dir / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def clean_run_dir(run_dir: Path) -> None:
    """Remove the sockets, holding files and state file; the logs and config stay."""
    leftovers = [*run_dir.glob("*.sock"), *run_dir.glob("*.holding")]
    for path in [*leftovers, run_dir / "state.json"]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
