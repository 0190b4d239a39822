"""The gateway's plumbing between HTTP and the deployment's client: the params roles
declare, n choices as n calls, a failed request as an OpenAI error."""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow.roles.gateway.schema import ApiError
from omniflow.runtime.client import Output, RequestFailed, Result
from omniflow.runtime.config import Config
from omniflow.runtime.loading import params_type

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


def choice(params: dict[str, Any], i: int, n: int, request_id: str) -> dict[str, Any]:
    """The i-th of n choices: its own request id and seed (seed + i)."""
    if n == 1:
        return {"params": params}
    seed = {"seed": params.get("seed", 0) + i}
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
