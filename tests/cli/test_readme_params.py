"""README's table of request parameters is what the roles declare (roles/options.py PARAMS).

Print the table with: python3 -m tests.cli.test_readme_params
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from msgspec import inspect as mi

from omniflow.roles.options import PARAMS

ROOT = Path(__file__).resolve().parents[2]


def _bounds(t: mi.Type) -> str:
    low = f">= {t.ge:g}" if getattr(t, "ge", None) is not None else ""
    low = low or (f"> {t.gt:g}" if getattr(t, "gt", None) is not None else "")
    high = f"<= {t.le:g}" if getattr(t, "le", None) is not None else ""
    return ", ".join(filter(None, [low, high]))


def _describe(t: mi.Type) -> tuple[str, str]:
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        kinds = [_describe(x)[0] for x in t.types]
        return " or ".join(kinds), ""
    if isinstance(t, mi.ListType):
        item, bounds = _describe(t.item_type)
        n = f"{t.min_length}" if t.min_length is not None and t.min_length == t.max_length else ""
        return f"[{n} × {item}]" if n else f"[{item}]", bounds
    name = {mi.IntType: "int", mi.FloatType: "float", mi.StrType: "str", mi.BoolType: "bool"}
    return name.get(type(t), str(t)), _bounds(t)


def params_table() -> str:
    by_struct: dict[type, list[str]] = {}
    for path, struct in PARAMS.items():
        by_struct.setdefault(struct, []).append(path)
    lines = []
    for struct, paths in by_struct.items():
        info = mi.type_info(struct)
        if not info.fields:
            continue
        lines.append(", ".join(f"`{p}`" for p in paths) + ":\n")
        lines.append("| param | type | range | default | |\n|---|---|---|---|---|")
        for f in info.fields:
            t, about = f.type, ""
            if isinstance(t, mi.Metadata):
                about = (t.extra_json_schema or {}).get("description", "")
                t = t.type
            kind, bounds = _describe(t)
            value = f.default if f.default_factory is mi.NODEFAULT else f.default_factory()
            default = msgspec.json.encode(value).decode()
            lines.append(f"| `{f.name}` | {kind} | {bounds} | `{default}` | {about} |")
        lines.append("")
    return "\n".join(lines).strip()


def test_readme_lists_every_declared_param_with_its_range():
    assert params_table() in (ROOT / "README.md").read_text(), (
        "README.md's parameter table is stale: print it with python3 -m tests.cli.test_readme_params"
    )


if __name__ == "__main__":
    print(params_table())
