"""The gateway's plumbing between HTTP and the deployment's client: the params roles
declare, n choices as n calls, a failed request as an OpenAI error."""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow.roles.gateway.schema import ApiError
from omniflow.runtime.client import Output, RequestFailed, Result
from omniflow.runtime.config import Config
from omniflow.runtime.loading import params_type
from omniflow.runtime.request_check import INT_MAX, INT_MIN, InvalidRequest, check_values

STATUS = {
    "bad_request": 400,
    "overloaded": 429,
    "unavailable": 503,
    "shutting_down": 503,
    "deadline": 504,
}


def declared_params(config: Config) -> set[str] | None:
    """Every request param some role of the graph declares; None when a role declares none
    (it may read any key)."""
    keys: set[str] = set()
    for role in config.roles.values():
        schema = params_type(role.actor)
        if schema is None:
            return None
        keys.update(schema.__struct_fields__)
    return keys


def check_param_names(given: dict[str, Any], known: set[str] | None, name: str) -> None:
    """A key of the ``params`` extension that no role reads is a typo: refuse it. Types
    and ranges are each role's to check (a bad one is its 400)."""
    if known is None:
        return
    for key in given:
        if key not in known:
            names = ", ".join(sorted(known)) or "none"
            raise ApiError(
                400, f"no role of {name} reads param {key!r}; known: {names}", f"params.{key}"
            )


def check_sizes(inputs: dict[str, Any], params: dict[str, Any], max_chars: int) -> None:
    """A 400 for an integer past 64 bits or a string past ``max_chars`` (a prompt that
    would cost the tokenizer seconds), before the request goes anywhere."""
    try:
        check_values(params, "params", max_chars)
        check_values(inputs, "inputs", max_chars)
    except InvalidRequest as e:
        field = e.field
        if field.startswith("inputs."):  # what the client sent it as
            field = "messages" if "messages" in inputs else "prompt"
        raise ApiError(400, str(e), field) from None


def session_of(req: Any, given: bytes | None, max_chars: int) -> str:
    """The chat's session (its body's, else the X-Session-Id header's); a 400 for a
    session or user id past ``max_chars`` (the llm keeps a session's state)."""
    session = req.session or (given or b"").decode("utf-8", "replace")
    for field, value in (("session", session), ("user", req.user or "")):
        if len(value) > max_chars:
            message = f"{len(value)} characters, more than {max_chars} ([gateway] max_id_chars)"
            raise ApiError(400, f"{field}: {message}", field)
    return session


def seed_of(seed: int, i: int) -> int:
    """The i-th choice's seed: ``seed + i``, wrapped into 64 bits."""
    return (seed + i - INT_MIN) % (INT_MAX - INT_MIN + 1) + INT_MIN


def choice(params: dict[str, Any], i: int, n: int, request_id: str) -> dict[str, Any]:
    """The i-th of n choices: its own request id and seed (seed + i)."""
    if n == 1:
        return {"params": params}
    seed = {"seed": seed_of(params.get("seed", 0), i)}
    return {"params": {**params, **seed}, "request_id": f"{request_id}-{i}"}


async def gather(calls: list) -> list[tuple[list[Output], Result]]:
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # one failed (or the client left): the others stop too
        for task in tasks:
            task.cancel()
        raise


def api_error(e: RequestFailed) -> ApiError:
    status = STATUS.get(e.code, 500)
    param = None
    if status == 400:
        field, sep, _ = e.detail.partition(": ")
        param = field if sep and " " not in field else None
    return ApiError(status, f"{e.role}: {e.detail}", param)
