"""omniflow send: one request, its text streamed, its images and audio written to files."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import typer

from omniflow.cli.common import (
    EXIT_NOT_RUNNING,
    EXIT_REQUEST,
    EXIT_USAGE,
    NameOpt,
    RegistryOpt,
    RunDirOpt,
    err,
    fail,
    find_running,
)

# The options of `omniflow send` that do not fit on the line of their parameter.
_TEXT_FILE = typer.Option(None, "--text-file", help="Text input read from this file (UTF-8).")
_IMAGE = typer.Option(
    [], "--image", "-i", help="An image file: PNG, JPEG, WebP, GIF or BMP (repeatable)."
)
_AUDIO = typer.Option(
    None, "--audio", "-a", help="A WAV file: 16-bit PCM or 32-bit float, mono or stereo, 8-48 kHz."
)
_WANT = typer.Option(None, "--want", "-w", help="Output modalities, some of text,image,audio.")
_MAX_TOKENS = typer.Option(
    None, "--max-tokens", min=1, help="Text tokens to generate (default 16)."
)
_CFG_SCALE = typer.Option(None, "--cfg-scale", help="Classifier-free guidance scale of an image.")
_SIZE = typer.Option(None, "--size", help="Generated image size: WIDTHxHEIGHT or auto.")
_PARAM = typer.Option(
    [],
    "--param",
    "-p",
    help="Request parameter KEY=VALUE (repeatable; VALUE as JSON where it parses).",
)
_SESSION = typer.Option("", "--session", help="Session id: continue a multi-turn dialogue.")
_OUT = typer.Option(
    None, "--out", "-o", help="Where images and audio are written (default: ./out)."
)
_TIMEOUT = typer.Option(
    None, "--timeout", help="Deadline in seconds, > 0 (default: the config's request_timeout_s)."
)
_JSON = typer.Option(False, "--json", help="One JSON object with outputs, files, timings, usage.")
_TRACE = typer.Option(
    False, "--trace", help="Trace the request (W3C trace context); print its span tree."
)
_ADDRESS = typer.Option(
    None, "--address", help="Where the actors reach this client (tcp; another host's)."
)


def send(
    text: str | None = typer.Option(None, "--text", "-t", help="Text input (-: read stdin)."),
    text_file: Path | None = _TEXT_FILE,
    image: list[Path] = _IMAGE,
    audio: Path | None = _AUDIO,
    want: str | None = _WANT,
    max_tokens: int | None = _MAX_TOKENS,
    seed: int | None = typer.Option(None, "--seed", help="Sampling or noise seed."),
    steps: int | None = typer.Option(None, "--steps", help="Denoising steps of an image."),
    cfg_scale: float | None = _CFG_SCALE,
    size: str | None = _SIZE,
    param: list[str] = _PARAM,
    session: str = _SESSION,
    out_dir: Path | None = _OUT,
    timeout: float | None = _TIMEOUT,
    as_json: bool = _JSON,
    trace: bool = _TRACE,
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
    registry: str | None = RegistryOpt,
    address: str | None = _ADDRESS,
) -> None:
    """Send one request: stream text to the terminal, write images (PNG) and audio (WAV) to --out."""
    from omniflow.cli import params as checks

    if text is None and text_file is None and not image and audio is None:
        fail("nothing to send: give --text, --text-file, --image or --audio", EXIT_USAGE)
    if timeout is not None and not timeout > 0:
        fail(f"--timeout {timeout:g}: expected seconds > 0", EXIT_USAGE)
    options = {"max_tokens": max_tokens, "seed": seed, "steps": steps, "cfg_scale": cfg_scale}
    params = _params(param, want, size, options)
    # Before anything is sent: a result must never be lost for want of a place to write it.
    out_dir = _out_dir(out_dir)
    if registry is not None and name is None:
        fail("--registry needs the deployment's --name", EXIT_USAGE)
    state = None if registry is not None else find_running(name, run_dir, any_host=True)
    inputs = _inputs(_text_input(text, text_file), image, audio)
    config = _config(state, registry, name)
    try:
        checks.map_size(params, config, "--size" if size is not None else "--param size")
        checks.check(params, config, inputs)
    except checks.ParamError as e:
        fail(str(e), EXIT_USAGE)
    import uvloop

    from omniflow.runtime.deployment import connect

    async def run() -> int:
        if state is None:
            conn = await connect(name, registry=registry, address=address)
        else:
            conn = await connect(run_dir=state["run_dir"], address=address)
        try:
            return await _stream(conn, inputs, params, session, timeout, out_dir, as_json, trace)
        finally:
            await conn.close()

    raise typer.Exit(uvloop.run(run()))


def _params(
    pairs: list[str], want: str | None, size: str | None, options: dict[str, Any]
) -> dict[str, Any]:
    """--param KEY=VALUE pairs with the first-class options over them, checked."""
    from omniflow.cli import params as checks

    try:
        params = checks.parse_pairs(pairs)
        for key, value in (
            ("want", None if want is None else checks.check_want(want)),
            *options.items(),
            ("size", None if size is None else checks.check_size(size)),
        ):
            if value is not None:
                params[key] = value
        if isinstance(params.get("want"), str):
            params["want"] = checks.check_want(params["want"])
    except checks.ParamError as e:
        fail(str(e), EXIT_USAGE)
    return params


def _inputs(text: str | None, image: list[Path], audio: Path | None) -> dict[str, Any]:
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
    return inputs


def _config(state: dict[str, Any] | None, registry: str | None, name: str | None) -> Any:
    """The running deployment's config: from its run dir, or its registry."""
    import uvloop

    from omniflow.runtime.config import from_json
    from omniflow.runtime.deployment import DeploymentNotFound, config_in_registry

    try:
        if state is None:
            return uvloop.run(config_in_registry(registry or "", name or ""))
        return from_json((Path(state["run_dir"]) / "deployment.json").read_bytes())
    except DeploymentNotFound as e:
        fail(str(e), EXIT_NOT_RUNNING)


async def _stream(
    conn: Any,
    inputs: dict[str, Any],
    params: dict[str, Any],
    session: str,
    timeout: float | None,
    out_dir: Path,
    as_json: bool,
    trace: bool,
) -> int:
    """Send the request on ``conn``, writing its outputs as they come; the exit code."""
    from omniflow.cli.outputs import OutputWriter
    from omniflow.runtime.client import Output, RequestFailed

    request_id = uuid.uuid4().hex
    writer = OutputWriter(out_dir, request_id, echo=not as_json)
    traced = _start_trace() if trace else None
    try:
        async for event in conn.stream(
            inputs, params=params, session=session, timeout=timeout, request_id=request_id
        ):
            if isinstance(event, Output):
                writer.add(event)
            else:
                writer.finish()
                _report(event, writer, as_json, traced)
                _say_missing(params.get("want"), writer, as_json)
    except RequestFailed as e:
        _report_failure(e, writer, as_json)
        # A request the deployment refused for its arguments is the caller's error.
        return EXIT_USAGE if e.code == "bad_request" else EXIT_REQUEST
    return 0


def _report_failure(e: Any, writer: Any, as_json: bool) -> None:
    if as_json:
        error = {"code": e.code, "role": e.role, "message": e.detail, "request_id": e.request_id}
        print(json.dumps({"error": error}))
        return
    if writer.text:
        sys.stdout.write("\n")
    err.print(f"request failed: {e}", style="red")


def _out_dir(given: Path | None) -> Path:
    """The folder for output files, checked: an explicit --out is created now if missing;
    anything there that is not a folder is a usage error."""
    path = given if given is not None else Path("out")
    if path.exists() and not path.is_dir():
        fail(f"--out {path}: exists and is not a directory", EXIT_USAGE)
    if given is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"--out {path}: cannot create the directory: {e.strerror}", EXIT_USAGE)
    return path


def _text_input(text: str | None, text_file: Path | None) -> str | None:
    """--text, --text - (stdin) or --text-file PATH: one of them."""
    if text is not None and text_file is not None:
        fail("--text and --text-file: give one of them", EXIT_USAGE)
    try:
        if text_file is not None:
            return text_file.read_text(encoding="utf-8")
        if text == "-":
            return sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
        where = text_file if text_file is not None else "stdin"
        fail(f"--text-file {where}: cannot read: {e}", EXIT_USAGE)
    return text


def _read_input(path: Path, option: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        fail(f"{option} {path}: cannot read: {e.strerror}", EXIT_USAGE)


def _start_trace() -> tuple[str, str, float]:
    """A new trace for this request: (trace id, the client's span id, when it began)."""
    import time

    from omniflow.runtime import tracing

    trace_id, span = tracing.trace_id(), tracing.span_id()
    tracing.CURRENT.set(tracing.traceparent(trace_id, span))
    return trace_id, span, time.time()


def _say_missing(want: Any, writer: Any, as_json: bool) -> None:
    """A modality asked for that came back empty (the model ended its audio before a
    sample, as a published LongCat-Next may) is said, not left silent."""
    if as_json or want is None:
        return
    wanted = {w.strip() for w in want.split(",")} if isinstance(want, str) else set(want)
    for kind in ("image", "audio"):
        if kind in wanted and kind not in writer.made:
            err.print(f"no {kind} came back: the model ended it before any was made")


def _report(result: Any, writer: Any, as_json: bool, traced: Any = None) -> None:
    timings: dict[str, float] = {}
    for t in result.timings:
        timings[t.role] = timings.get(t.role, 0.0) + t.compute_ms
    tree: list[str] = []
    if traced is not None:
        from omniflow.cli.trace_tree import span_tree

        trace_id, root, started = traced
        tree = span_tree(trace_id, root, started, result.latency_ms, result.timings)
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
                    **({"trace": tree} if tree else {}),
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
    for line in tree:
        err.print(line, style="dim", highlight=False, markup=False, soft_wrap=True)
