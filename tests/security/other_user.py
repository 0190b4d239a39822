"""A second local user against live deployments: what another account on the machine can
reach of root's (issue #40's second-user phase, for tests and benchmarks/fuzz.py).

As root, ``targets`` lists what a deployment has on this host: its run root and run dir
with every file and socket in them, its pool segments in /dev/shm, its processes and its
gateway. ``second_user_phase`` then runs a stdlib-only probe as the user ``OTHER`` (made
with ``useradd`` when missing) that tries each: list and read the folders and files,
plant a file, connect to every socket, open the segments, signal the processes, find the
gateway's key in a readable place (a command line, a file), and call the gateway without
the key or with a forged Host. Anything that works is a breach.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from omniflow.memory.segment import SHM_DIR

OTHER = "ofadv"

# Runs as the other user, with nothing but the standard library (the project's venv may
# sit where that user cannot read). Reads its targets as JSON on stdin.
PROBE = r"""
import http.client, json, os, signal, socket, sys
t = json.load(sys.stdin)
tried, breaches = 0, []

def attempt(what, fn):
    global tried
    tried += 1
    try:
        got = fn()
    except (OSError, ValueError):
        return
    if got is not False:
        breaches.append(what)

for d in t["dirs"]:
    attempt(f"listed {d}", lambda: os.listdir(d))
    attempt(f"planted a file in {d}", lambda: open(os.path.join(d, "planted"), "x").close())
for f in t["files"]:
    attempt(f"read {f}", lambda: open(f, "rb").read(1))
    attempt(f"wrote {f}", lambda: open(f, "ab").close())
for s in t["sockets"]:
    def connect(s=s):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect(s)
        finally:
            c.close()
    attempt(f"connected to {s}", connect)
for m in t["segments"]:
    attempt(f"opened {m}", lambda: os.close(os.open(m, os.O_RDONLY)))
for pid in t["pids"]:
    attempt(f"signalled pid {pid}", lambda: os.kill(pid, 0))
    attempt(f"read pid {pid}'s environment", lambda: open(f"/proc/{pid}/environ", "rb").read())
    def key_in_cmdline(pid=pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return t["secret"].encode() in f.read() or False
    attempt(f"found the key in pid {pid}'s command line", key_in_cmdline)

def status(method, path, headers, body=None):
    conn = http.client.HTTPConnection(t["host"], t["port"], timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        code = conn.getresponse().status
    finally:
        conn.close()
    return code < 300 or False

chat = json.dumps({"model": t["model"], "messages": [{"role": "user", "content": "hi"}]})
plain = {"content-type": "application/json"}
if t["host"]:
    attempt("chat without the key", lambda: status("POST", "/v1/chat/completions", plain, chat))
    wrong = {**plain, "authorization": "Bearer sk-guess"}
    attempt("chat with a guessed key", lambda: status("POST", "/v1/chat/completions", wrong, chat))
    forged = {**plain, "host": "evil.example:8000"}
    attempt("chat with a forged Host", lambda: status("POST", "/v1/chat/completions", forged, chat))
    attempt("/metrics without the key", lambda: status("GET", "/metrics", {}))
    attempt("/v1/models without the key", lambda: status("GET", "/v1/models", {}))
print(json.dumps({"tried": tried, "breaches": breaches}))
"""


def other_uid() -> int:
    """The uid of ``OTHER``, made (no home, no shell) if it does not exist yet. Root only."""
    try:
        return pwd.getpwnam(OTHER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", OTHER], check=True)
        return pwd.getpwnam(OTHER).pw_uid


def targets(rt: Any, gateway_url: str = "", secret: str = "", model: str = "") -> dict:
    """Everything of the deployment ``rt`` (a started ``omniflow.Runtime``) on this host."""
    supervisor = rt.supervisor
    run_dir = Path(supervisor.run_dir)
    dirs, files, sockets = [str(run_dir.parent), str(run_dir)], [], []
    for path in run_dir.rglob("*"):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            dirs.append(str(path))
        elif stat.S_ISSOCK(mode):
            sockets.append(str(path))
        elif stat.S_ISREG(mode):
            files.append(str(path))
    pool = supervisor.pool
    # The segment and its side files (segment_path(name) + a suffix).
    segments = [str(p) for p in Path(SHM_DIR).glob(f"{pool.name}*")] if pool else []
    pids = [os.getpid(), *(r.proc.pid for r in supervisor.replicas if r.proc is not None)]
    host, _, port = gateway_url.removeprefix("http://").rpartition(":")
    return {
        "dirs": dirs,
        "files": files,
        "sockets": sockets,
        "segments": segments,
        "pids": pids,
        "secret": secret or "\0never",
        "host": host,
        "port": int(port or 0),
        "model": model,
    }


def second_user_phase(found: dict) -> dict:
    """Run the probe as ``OTHER`` against ``found`` (``targets``); {"tried", "breaches"}."""
    uid = other_uid()
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    proc = subprocess.run(
        [python, "-I", "-c", PROBE],
        input=json.dumps(found),
        capture_output=True,
        text=True,
        user=uid,
        group=pwd.getpwuid(uid).pw_gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the second user's probe failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
