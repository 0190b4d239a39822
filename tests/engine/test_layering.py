"""The engine imports only torch/safetensors/tokenizers/numpy, omniflow.models,
omniflow.kernels and omniflow.cache (DESIGN.md's layer rule, with the CPU kernels in the
compute layer); it never sees sockets or messages."""

import ast
from pathlib import Path

import omniflow.engine

ALLOWED_THIRD_PARTY = {"torch", "safetensors", "tokenizers", "numpy"}
ALLOWED_OURS = ("omniflow.engine", "omniflow.models", "omniflow.kernels", "omniflow.cache")


def test_engine_imports_respect_the_layer_rule():
    for file in Path(omniflow.engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root == "omniflow":
                    assert name.startswith(ALLOWED_OURS), f"{file.name} imports {name}"
                elif root not in ALLOWED_THIRD_PARTY:
                    assert root in _stdlib(), f"{file.name} imports {name}"


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}
