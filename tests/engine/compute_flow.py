"""Shared pieces of the Compute Flow tests: a greedy codes head and the full-recompute oracle
(the path the LongCat llm role used before media tokens ran through the engine)."""

import torch

from omniflow.engine.heads import guided


class GreedyHead:
    """K codebooks of V ids: argmax of a random projection; embedder: summed random tables."""

    placeholder_id = 0

    def __init__(self, hidden: int, key: str = "image", levels: int = 3, ids: int = 17, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.key, self.levels, self.ids = key, levels, ids
        self.projection = torch.randn(hidden, levels * ids, generator=generator)
        self.tables = torch.randn(levels, ids, hidden, generator=generator) * 0.5
        self.seen: list[torch.Tensor] = []  # every hidden state the engine handed in

    def codes(self, hidden: torch.Tensor, pick=None) -> torch.Tensor:
        self.seen.append(hidden.detach().clone())
        logits = (hidden.float() @ self.projection).view(-1, self.levels, self.ids)
        if pick is None:
            return logits.argmax(-1)
        return torch.stack([pick(level, logits[:, level]) for level in range(self.levels)], -1)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.tables[torch.arange(self.levels), codes].sum(1)


class TanhHead(GreedyHead):
    """GreedyHead with logits tanh(hidden @ projection): not linear in the hidden state."""

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(hidden.float() @ self.projection).view(-1, self.levels, self.ids)

    def codes(self, hidden: torch.Tensor, pick=None) -> torch.Tensor:
        self.seen.append(hidden.detach().clone())
        return self._logits(hidden).argmax(-1)


class LogitGuidedHead(TanhHead):
    """TanhHead that guides each level's logits itself (guided_codes), as LongCat-Next's
    image head does."""

    def guided_codes(self, cond, uncond, scale, pick=None) -> torch.Tensor:
        self.seen.append(cond.detach().clone())
        c, u = self._logits(cond), self._logits(uncond)
        return (u + scale[:, None, None] * (c - u)).argmax(-1)


def embed(model, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.embed(torch.tensor(token_ids)).clone()


@torch.inference_mode()
def recompute_codes(
    model, head, prompt, n, uncond_prompt=None, scale=1.0, row_end=None, picker=None
):
    """n media tokens by re-running the whole context through the model for each one;
    ``row_end`` (token, width): that token's own row after every width of them (n counts
    those steps too); ``picker(rows so far)``: the head's pick for the next one."""
    context = embed(model, prompt)
    uncond = None if uncond_prompt is None else embed(model, uncond_prompt)
    rows, states = [], []
    for index in range(n):
        if row_end is not None and (index + 1) % (row_end[1] + 1) == 0:
            step = embed(model, [row_end[0]])
            context = torch.cat([context, step])
            if uncond is not None:
                uncond = torch.cat([uncond, step])
            continue
        hidden = model.hidden_states(context)[-1:]
        pick = None if picker is None else picker(rows)
        if uncond is not None and hasattr(head, "guided_codes"):  # the head guides logits
            base = model.hidden_states(uncond)[-1:]
            states.append(hidden[0])
            ids = head.guided_codes(hidden, base, torch.tensor([scale]), pick)
        else:
            if uncond is not None:
                hidden = guided(hidden, model.hidden_states(uncond)[-1:], scale)
            states.append(hidden[0])
            ids = head.codes(hidden, pick)
        rows.append(ids[0])
        step = head.embed(ids).to(context.dtype)
        context = torch.cat([context, step])
        if uncond is not None:
            uncond = torch.cat([uncond, step])
    return torch.stack(rows), torch.stack(states)


def run(engine):
    """Every delta of a run to completion, grouped by request: {request_id: [deltas]}."""
    out: dict[str, list] = {}
    for delta in engine.run_to_completion():
        out.setdefault(delta.request_id, []).append(delta)
    return out


def codes_of(deltas) -> torch.Tensor:
    return torch.cat([d.codes for d in deltas if d.codes is not None])
