# omniflow recipes. `just` itself comes from PyPI (rust-just); scripts/setup.sh installs it.

default:
    @just --list

# Install everything: Python deps (CPU torch without a GPU), just, the etcd server.
setup:
    bash scripts/setup.sh

# Start a deployment in the foreground (Ctrl-C stops it).
up config="configs/longcat.toml":
    omniflow up {{config}}

# The test suite (GPU tests skip without CUDA).
test *args:
    python3 -m pytest -q {{args}}

# Every benchmark; each prints a JSON object as its last line.
bench:
    python3 benchmarks/hop.py
    python3 benchmarks/routing.py
    python3 benchmarks/transport.py
    python3 benchmarks/engine.py
    python3 benchmarks/pipeline.py

lint:
    ruff check omniflow tests benchmarks
    ruff format --check omniflow tests benchmarks
    mypy omniflow
    lint-imports
