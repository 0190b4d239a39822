"""A role that declares the image-generation parameters and answers with what it got.

Workers import it as tests.cli.param_roles:Painter. Its ``Params`` is a class attribute
(not listed in omniflow.roles.options.PARAMS): the CLI finds it by importing the class.
"""

from __future__ import annotations

import json
import re
from typing import Annotated

import msgspec
from msgspec import Meta

from omniflow.roles.options import read_params
from omniflow.runtime.actor import Actor, BadRequest


class PainterParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    seed: int = 0
    steps: Annotated[int, Meta(ge=1, le=50)] = 4
    cfg_scale: Annotated[float, Meta(ge=0, le=20)] = 3.0
    size: str = "auto"


class Painter(Actor):
    Params = PainterParams

    async def handle(self, request, ctx):
        params = read_params(PainterParams, request.params)
        match = re.fullmatch(r"(\d+)x(\d+)", params.size)
        if params.size != "auto" and (not match or int(match[1]) > 1024):
            raise BadRequest("params.size", f"expected auto or up to 1024x1024, got {params.size}")
        return {"text": json.dumps(msgspec.to_builtins(params), sort_keys=True)}
