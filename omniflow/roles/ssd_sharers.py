"""How many processes on this host share ``cache.ssd_capacity``: each takes at most its
fair part of it (memory/ssd_share.py). Counted from the deployment's config: the replicas
of the roles this host runs whose options keep an SSD tier (``spills_to_ssd()``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from omniflow.runtime.loading import options_type
from omniflow.runtime.tables import decode

if TYPE_CHECKING:
    from omniflow.runtime.config import Config


def ssd_sharers(config: Config) -> int:
    """The processes this host runs that keep an SSD tier in ``[cache] ssd_dir`` (0 where
    it is unset): the replicas of its roles whose options' ``spills_to_ssd()`` says so.
    Each takes at most its fair part of cache.ssd_capacity (memory/ssd_share.py)."""
    if not config.cache.ssd_dir:
        return 0
    count = 0
    for name, role in config.local_processes().items():
        schema = options_type(role.actor)
        if not callable(getattr(schema, "spills_to_ssd", None)):
            continue
        try:
            options = decode(role.options, schema, ("roles", name, "options"), "option")
        except ValueError:  # checked at load already; one that fails here is not counted
            continue
        count += role.replicas if options.spills_to_ssd() else 0
    return count


def deployment_ssd_sharers() -> int:
    """``ssd_sharers`` of the deployment this process is a replica of (its run dir's
    deployment.json, named by the supervisor in ``OMNIFLOW_RUN_DIR``, as the gateway reads
    it), at least 1; 1 outside a deployment (a role or cache built directly)."""
    run_dir = os.environ.get("OMNIFLOW_RUN_DIR")
    if not run_dir:
        return 1
    from omniflow.runtime.config import from_json

    return max(1, ssd_sharers(from_json((Path(run_dir) / "deployment.json").read_bytes())))
