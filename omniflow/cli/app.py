"""omniflow up | status | send | logs | down: start, inspect, use and stop a deployment.

Exit codes: 0 ok; 1 the deployment failed to start or stop; 2 a bad config or
argument (a request the deployment refused as bad_request included); 3 no such
deployment running; 4 the request failed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import signal
import subprocess
import sys
import time
import typing
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from omniflow.cli.progress import StartProgress
from omniflow.runtime.config import ConfigError, load
from omniflow.runtime.deployment import DeploymentNotFound, SeveralDeployments, find_deployment
from omniflow.runtime.supervisor import StartError, Supervisor, default_run_dir

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode="markdown"
)
# Messages are plain text: no markup (errors quote "[bad_request]", "[h, w]", "[roles.x]"),
# no highlighting, and no wrapping (a piped line stays one line for grep).
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
# Piped, a table is as wide as its cells (no column cropped to fit 80).
out = Console(
    markup=False, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 10_000
)

EXIT_START, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_REQUEST = 1, 2, 3, 4

NameOpt = typer.Option(
    None, "--name", "-n", help="Deployment name (default: the only one running)."
)
RunDirOpt = typer.Option(None, "--run-dir", help="The deployment's run directory.")


def _print_version(value: bool) -> None:
    if value:
        from omniflow import __version__

        print(f"omniflow {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    pass


def _load(config: Path) -> Any:
    try:
        return load(config)
    except ConfigError as e:
        _fail(f"config error: {e}", EXIT_USAGE)


def _fail(message: str, code: int) -> typing.NoReturn:
    err.print(message, style="red")
    raise typer.Exit(code)


def _state(name: str | None, run_dir: Path | None) -> dict[str, Any]:
    try:
        return find_deployment(name, run_dir)
    except SeveralDeployments as e:
        _fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        _fail(str(e), EXIT_NOT_RUNNING)


@app.command()
def up(
    config: Path = typer.Argument(..., help="Deployment config (TOML)."),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once ready; run in the background."
    ),
    run_dir: Path | None = RunDirOpt,
    port: int | None = typer.Option(
        None,
        "--port",
        envvar="OMNIFLOW_GATEWAY_PORT",
        min=0,
        max=65535,
        help="The HTTP gateway's port (0: any free one), over [gateway] port.",
    ),
    ready_fd: int = typer.Option(-1, hidden=True),
) -> None:
    """Start a deployment and wait until every actor is ready."""
    cfg = _load(config)
    run_dir = run_dir or Path(cfg.runtime.run_dir or default_run_dir(cfg.name))
    if port is not None and cfg.gateway is not None:
        cfg.gateway.port = port
    if detach:
        raise typer.Exit(_detach(config, run_dir, port))
    import uvloop

    raise typer.Exit(uvloop.run(_serve(cfg, run_dir, ready_fd)))


async def _serve(cfg: Any, run_dir: Path, ready_fd: int) -> int:
    notify = os.fdopen(ready_fd, "w", buffering=1) if ready_fd >= 0 else None

    total = sum(rc.replicas for rc in cfg.processes().values())
    bar = StartProgress(total) if notify is None else None

    running = False  # ready: what follows are restarts, after the bar or the ready pipe

    def progress(actor_id: str, state: str) -> None:
        if running or (notify is not None and notify.closed):
            # One line per change, to the terminal (or supervisor.log when detached).
            print(f"{time.strftime('%H:%M:%S')} {actor_id} {state}", file=sys.stderr, flush=True)
        elif notify is not None:
            notify.write(f"progress {actor_id} {state}\n")
        elif bar is not None:
            bar.update(actor_id, state)

    sup = Supervisor(cfg, run_dir, progress)
    if notify is None:
        err.print(f"starting {cfg.name} ({total} actors) in {run_dir}")
    started = time.monotonic()
    try:
        if bar is not None:
            with bar:
                await sup.start()
        else:
            await sup.start()
    except (StartError, OSError) as e:
        if notify is not None:
            notify.write(f"error {e}\n")
            notify.close()
        else:
            err.print(f"failed to start: {e}", style="red")
        return EXIT_START
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop)
    where = sup.registry_address
    message = (
        f"ready {cfg.name}: {len(sup.replicas)} actors in {time.monotonic() - started:.1f}s; "
        f"registry {where}; run dir {run_dir}"
    )
    url = run_dir / "gateway.url"  # written by the gateway once it listens
    if cfg.gateway is not None and url.exists():
        message += f"; http {url.read_text().strip()}"
    running = True
    if notify is not None:
        notify.write(message + "\n")
        notify.close()
    else:
        err.print(message, style="green")
        err.print("stop with Ctrl-C or: omniflow down")
    await sup.wait()
    return 0


def _detach(config: Path, run_dir: Path, port: int | None = None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    read_end, write_end = os.pipe()
    log_path = run_dir / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniflow.cli",
                "up",
                str(config),
                "--run-dir",
                str(run_dir),
                "--ready-fd",
                str(write_end),
                *(["--port", str(port)] if port is not None else []),
            ],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    os.close(write_end)
    cfg = load(config)
    bar = StartProgress(sum(rc.replicas for rc in cfg.processes().values()))
    with os.fdopen(read_end) as lines, bar:
        for line in lines:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "progress":
                actor_id, _, state = rest.partition(" ")
                bar.update(actor_id, state)
                continue
            bar.stop()
            if kind == "ready":
                out.print(f"ready {rest} (supervisor pid {proc.pid})", style="green")
                return 0
            elif kind == "error":
                err.print(f"failed to start: {rest}", style="red")
                return EXIT_START
    err.print(f"the supervisor exited before it was ready; see {log_path}", style="red")
    return EXIT_START


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """List every actor of a running deployment, a replica being restarted included.

    Columns: role, replica, pid, endpoint, state, requests in flight and served, restarts."""
    state = _state(name, run_dir)
    import uvloop

    from omniflow.runtime.deployment import list_deployment_actors

    records = uvloop.run(list_deployment_actors(state))
    # The supervisor's view (state.json) names what the registry cannot: a replica being
    # restarted has no record there, and only the supervisor counts restarts.
    supervised = {(a["role"], a["replica"]): a for a in state.get("actors", [])}
    actors = [
        {
            "role": r.role,
            "replica": r.replica,
            "pid": r.pid,
            "endpoint": r.endpoint,
            "state": r.state,
            "inflight": r.inflight,
            "served": r.served,
            "restarts": supervised.pop((r.role, r.replica), {}).get("restarts", 0),
            "host": r.host,
        }
        for r in records
    ]
    for a in supervised.values():
        actors.append(
            {
                "role": a["role"],
                "replica": a["replica"],
                "pid": a["pid"],
                "endpoint": "",
                "state": a["state"] if a["state"] != "ready" else "unregistered",
                "inflight": 0,
                "served": 0,
                "restarts": a["restarts"],
                "host": "",
            }
        )
    actors.sort(key=lambda a: (a["role"], a["replica"]))
    if as_json:
        print(
            json.dumps(
                {
                    "name": state["name"],
                    "supervisor_pid": state["pid"],
                    "run_dir": state["run_dir"],
                    "registry": state["registry"],
                    "actors": actors,
                }
            )
        )
        return
    from rich.table import Table

    table = Table(title=f"{state['name']} (supervisor pid {state['pid']})")
    columns = ("role", "replica", "pid", "endpoint", "state", "inflight", "served", "restarts")
    for col in columns:
        table.add_column(col)
    for a in actors:
        table.add_row(*(str(a[c]) for c in columns))
    out.print(table, crop=False)


@app.command()
def send(
    text: str | None = typer.Option(None, "--text", "-t", help="Text input."),
    image: list[Path] = typer.Option(
        [], "--image", "-i", help="An image file: PNG, JPEG, WebP, GIF or BMP (repeatable)."
    ),
    audio: Path | None = typer.Option(
        None,
        "--audio",
        "-a",
        help="A WAV file: 16-bit PCM or 32-bit float, mono or stereo, 8-48 kHz.",
    ),
    want: str | None = typer.Option(
        None, "--want", "-w", help="Output modalities, some of text,image,audio."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Text tokens to generate (default 16)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Sampling or noise seed."),
    steps: int | None = typer.Option(None, "--steps", help="Denoising steps of an image."),
    cfg_scale: float | None = typer.Option(
        None, "--cfg-scale", help="Classifier-free guidance scale of an image."
    ),
    size: str | None = typer.Option(
        None, "--size", help="Generated image size: WIDTHxHEIGHT or auto."
    ),
    param: list[str] = typer.Option(
        [],
        "--param",
        "-p",
        help="Request parameter KEY=VALUE (repeatable; VALUE as JSON where it parses).",
    ),
    session: str = typer.Option(
        "", "--session", help="Session id: continue a multi-turn dialogue."
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", "-o", help="Where images and audio are written (default: ./out)."
    ),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        help="Deadline in seconds, > 0 (default: the config's request_timeout_s).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object with outputs, files, timings, usage."
    ),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """Send one request: stream text to the terminal, write images (PNG) and audio (WAV) to --out."""
    from omniflow.cli import params as checks

    if text is None and not image and audio is None:
        _fail("nothing to send: give --text, --image or --audio", EXIT_USAGE)
    if timeout is not None and not timeout > 0:
        _fail(f"--timeout {timeout:g}: expected seconds > 0", EXIT_USAGE)
    try:
        params = checks.parse_pairs(param)
        for key, value in (
            ("want", None if want is None else checks.check_want(want)),
            ("max_tokens", max_tokens),
            ("seed", seed),
            ("steps", steps),
            ("cfg_scale", cfg_scale),
            ("size", None if size is None else checks.check_size(size)),
        ):
            if value is not None:
                params[key] = value
        if isinstance(params.get("want"), str):
            params["want"] = checks.check_want(params["want"])
    except checks.ParamError as e:
        _fail(str(e), EXIT_USAGE)
    # Before anything is sent: a result must never be lost for want of a place to write it.
    out_dir = _out_dir(out_dir)
    state = _state(name, run_dir)
    inputs: dict[str, Any] = {}
    if text is not None:
        inputs["text"] = text
    images = [_read_input(path, "--image") for path in image]
    if len(images) == 1:
        inputs["image"] = images[0]
    elif images:
        inputs["images"] = images
    if audio is not None:
        inputs["audio"] = _read_input(audio, "--audio")
    import uvloop

    from omniflow.cli.outputs import OutputWriter
    from omniflow.runtime.client import Output, RequestFailed
    from omniflow.runtime.config import from_json
    from omniflow.runtime.deployment import connect

    config = from_json((Path(state["run_dir"]) / "deployment.json").read_bytes())
    try:
        checks.check(params, config)
    except checks.ParamError as e:
        _fail(str(e), EXIT_USAGE)

    async def run() -> int:
        conn = await connect(run_dir=state["run_dir"])
        request_id = uuid.uuid4().hex
        writer = OutputWriter(out_dir, request_id, echo=not as_json)
        try:
            async for event in conn.stream(
                inputs, params=params, session=session, timeout=timeout, request_id=request_id
            ):
                if isinstance(event, Output):
                    writer.add(event)
                else:
                    writer.finish()
                    _report(event, writer, as_json)
        except RequestFailed as e:
            if as_json:
                print(
                    json.dumps(
                        {
                            "error": {
                                "code": e.code,
                                "role": e.role,
                                "message": e.detail,
                                "request_id": e.request_id,
                            }
                        }
                    )
                )
            else:
                if writer.text:
                    sys.stdout.write("\n")
                err.print(f"request failed: {e}", style="red")
            # A request the deployment refused for its arguments is the caller's error.
            return EXIT_USAGE if e.code == "bad_request" else EXIT_REQUEST
        finally:
            await conn.close()
        return 0

    raise typer.Exit(uvloop.run(run()))


def _out_dir(given: Path | None) -> Path:
    """The folder for output files, checked: an explicit --out is created now if missing;
    anything there that is not a folder is a usage error."""
    path = given if given is not None else Path("out")
    if path.exists() and not path.is_dir():
        _fail(f"--out {path}: exists and is not a directory", EXIT_USAGE)
    if given is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _fail(f"--out {path}: cannot create the directory: {e.strerror}", EXIT_USAGE)
    return path


def _read_input(path: Path, option: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        _fail(f"{option} {path}: cannot read: {e.strerror}", EXIT_USAGE)


def _report(result: Any, writer: Any, as_json: bool) -> None:
    timings: dict[str, float] = {}
    for t in result.timings:
        timings[t.role] = timings.get(t.role, 0.0) + t.compute_ms
    if as_json:
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": writer.text,
                    "outputs": writer.outputs,
                    "files": writer.files,
                    "timings_ms": timings,
                    "latency_ms": result.latency_ms,
                    "usage": result.usage,
                }
            )
        )
        return
    if writer.text:
        sys.stdout.write("\n")
    for path in writer.files:
        err.print(f"wrote {path}")
    parts = ", ".join(f"{role} {ms:.1f} ms" for role, ms in timings.items())
    usage = ", ".join(f"{k} {v}" for k, v in sorted(result.usage.items()))
    err.print(f"{result.latency_ms:.1f} ms end to end; compute: {parts}", style="dim")
    if usage:
        err.print(f"usage: {usage}", style="dim")


@app.command()
def logs(
    role: str | None = typer.Argument(
        None, help="A role (all its replicas), ROLE-N (one replica), or supervisor."
    ),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing what is added."),
    lines: int = typer.Option(50, "--lines", "-l", min=0, help="Lines from the end of each."),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """Print the end of a role's log; without ROLE, list the deployment's logs.

    Each replica logs to RUN_DIR/logs/ROLE-N.log; a detached supervisor to
    RUN_DIR/supervisor.log. A stopped deployment's logs stay: name it with --name or
    --run-dir."""
    folder = _log_folder(name, run_dir)
    found = sorted((folder / "logs").glob("*.log"))
    if (folder / "supervisor.log").exists():
        found.append(folder / "supervisor.log")
    if role is None:
        for path in found:
            out.print(f"{path.stem:<24} {path.stat().st_size:>10} bytes  {path}")
        return
    chosen = [p for p in found if p.stem == role or p.stem.rpartition("-")[0] == role]
    if not chosen:
        names = sorted(
            {p.stem.rpartition("-")[0] or p.stem for p in found} | {p.stem for p in found}
        )
        _fail(f"no log of {role!r} in {folder}; there are: {', '.join(names)}", EXIT_USAGE)
    if follow:  # tail follows renames and truncation, and stops on Ctrl-C
        os.execvp("tail", ["tail", "-n", str(lines), "-F", *map(str, chosen)])
    for path in chosen:
        if len(chosen) > 1:
            print(f"==> {path} <==")
        with open(path, "rb") as f:
            tail = collections.deque(f, maxlen=lines) if lines else ()
        sys.stdout.write(b"".join(tail).decode(errors="replace"))
    sys.stdout.flush()


def _log_folder(name: str | None, run_dir: Path | None) -> Path:
    """The run dir whose logs to read: a running deployment's, or one named (stopped too)."""
    if run_dir is not None and run_dir.is_dir():
        return run_dir
    try:
        return Path(find_deployment(name, run_dir)["run_dir"])
    except SeveralDeployments as e:
        _fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        if name is not None and default_run_dir(name).is_dir():
            return default_run_dir(name)
        _fail(str(e), EXIT_NOT_RUNNING)


@app.command()
def down(
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
    timeout: float = typer.Option(
        30.0, "--timeout", help="Seconds in-flight requests may take to finish."
    ),
) -> None:
    """Stop a running deployment, letting the requests in flight finish.

    New requests are refused; those in flight finish through the whole graph (up to
    --timeout); then every actor stops and its sockets are removed."""
    from omniflow.runtime.deployment import clean_dead, request_stop

    try:
        state = find_deployment(name, run_dir)
    except SeveralDeployments as e:
        _fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        cleaned = clean_dead(name, run_dir)
        if cleaned:  # its supervisor died: take away what it could not
            out.print(f"cleaned up after the dead supervisor of {', '.join(cleaned)}")
            return
        _fail(str(e), EXIT_NOT_RUNNING)
    pid = state["pid"]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        err.print("the supervisor is already gone", style="yellow")
        return
    request_stop(state, timeout)
    # The supervisor drains for up to `timeout`, then kills what is left: a little longer.
    ready, _, _ = select.select([pidfd], [], [], timeout + 5.0)
    os.close(pidfd)
    if not ready:
        _fail(f"supervisor {pid} did not stop within {timeout:g}s", EXIT_START)
    leftovers = list(Path(state["run_dir"]).glob("*.sock"))
    if leftovers:
        _fail(f"left behind: {', '.join(map(str, leftovers))}", EXIT_START)
    out.print(f"stopped {state['name']}")
