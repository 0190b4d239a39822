"""transformers' LongCat-Flash modules on per-expert checkpoint tensors: the experts stacked
into its fused parameters by hand.

Its `gate_up_proj` has had rows for the zero (identity) experts too, left zero, in
transformers up to 5.24, and only the routed experts' rows since 5.25; the rows are padded
to whatever the installed module declares."""

from __future__ import annotations

import re

import torch


def load_stacked_experts(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load `tensors` (names relative to `model`) into `model`, stacking
    `<prefix>.experts.<e>.{gate,up,down}_proj.weight` into `<prefix>.experts.gate_up_proj`
    and `.down_proj`; asserts that no parameter is left out or unexpected."""
    state, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if match:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
        else:
            state[name] = tensor
    for prefix, parts in experts.items():
        routed = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(routed)]
        rows = model.get_parameter(f"{prefix}.gate_up_proj").shape[0]
        gate_up += [torch.zeros_like(gate_up[0])] * (rows - routed)
        state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(routed)])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
