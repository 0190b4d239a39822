#!/usr/bin/env bash
# Set up omniflow on a fresh Debian/Ubuntu machine: a virtual environment with the Python
# deps (CPU torch unless a GPU is present) and `just`, the etcd server that the registry
# tests start, and a C compiler; with the browser extra, Debian's chromium.
#
# Everything Python goes into a virtual environment made with $PYTHON (default python3):
# .venv at the project root, or $OMNIFLOW_VENV (a relative path is taken from the project
# root). Always, not only where the interpreter is externally managed (PEP 668, as the
# system python3 of Debian 12 and Ubuntu 24.04 is): one behaviour everywhere, and nothing
# is ever installed into the interpreter itself. A second run reuses the environment.
#
#   scripts/setup.sh                 set everything up
#   scripts/setup.sh --print-python  make (or reuse) the environment only, print the
#                                    interpreter pip would install into; install nothing
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${OMNIFLOW_EXTRAS:-dev,etcd}
VENV=${OMNIFLOW_VENV:-.venv}
case $VENV in /*) ;; *) VENV="$PWD/$VENV" ;; esac
VPY="$VENV/bin/python"

PRINT_PYTHON=0
case "${1:-}" in
  "") ;;
  --print-python) PRINT_PYTHON=1 ;;
  *) echo "usage: scripts/setup.sh [--print-python]" >&2; exit 2 ;;
esac

die() { echo "setup: $*" >&2; exit 1; }

# Run one step of the setup, saying what it does before and how long it took after:
# `step "what" command args...` (a pip install is a minute of silence otherwise).
step() {
  local what=$1 began=$SECONDS
  shift
  echo "setup: $what ..." >&2
  # Its own status, also where `set -e` does not reach (a step under `||`).
  "$@" || {
    local status=$?
    echo "setup: $what: failed after $((SECONDS - began))s" >&2
    return $status
  }
  echo "setup: $what: done in $((SECONDS - began))s" >&2
}

# torch's CPU build, on a machine without a GPU: PyTorch's own CPU wheel index first (the
# default index's torch is the multi-GB CUDA build), then, if that index cannot be
# reached or lacks the pin, the default index and whatever pip is configured with (a
# local wheel folder here). Short timeouts: an unreachable index costs seconds, not the
# configured default's minutes.
TORCH_CPU_INDEX=${OMNIFLOW_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
install_cpu_torch() {
  "$VPY" -m pip install -q --disable-pip-version-check -c constraints-cpu.txt \
    --index-url "$TORCH_CPU_INDEX" --timeout 20 --retries 1 torch && return 0
  echo "setup: $TORCH_CPU_INDEX gave no torch; trying the default index" >&2
  "$VPY" -m pip install -q --disable-pip-version-check -c constraints-cpu.txt torch
}

# The environment at $VENV is usable: a virtual environment with pip, made from $PY.
venv_ok() {
  [ -x "$VPY" ] || return 1
  local mine base
  mine=$("$VPY" -c 'import sys; assert sys.prefix != sys.base_prefix; import pip
print(sys.base_prefix)' 2>/dev/null) || return 1
  base=$("$PY" -c 'import sys; print(sys.base_prefix)') || return 1
  [ "$mine" = "$base" ]
}

# The one check between pip and the system: the interpreter pip installs into is a virtual
# environment's, so no externally managed interpreter (PEP 668) is ever written to.
refuse_unless_venv() {
  "$1" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' ||
    die "refusing to install into $1: not a virtual environment's interpreter"
}

command -v "$PY" >/dev/null 2>&1 || [ "$PY" = python3 ] || die "no interpreter $PY"

# Debian packages, in one apt run: the etcd server the registry tests start, a C compiler
# for omniflow's CPU kernels (without one the engine keeps PyTorch ops), and python3 with
# its venv module (Debian and Ubuntu ship ensurepip apart, in python3.X-venv) where the
# environment has yet to be made and cannot be without them.
PACKAGES=()
if [ $PRINT_PYTHON = 0 ]; then
  command -v etcd >/dev/null 2>&1 || PACKAGES+=(etcd-server)
  command -v cc >/dev/null 2>&1 || PACKAGES+=(gcc libc6-dev)
  # iproute2's ip: the scale-out tests make network namespaces with it (as root).
  [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || PACKAGES+=(iproute2)
  # tcmalloc, which the supervisor preloads into workers (omniflow/runtime/preload.py).
  ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 || PACKAGES+=(libtcmalloc-minimal4)
  # The browser extra (OMNIFLOW_EXTRAS=...,browser; .ci/run asks for it): the playground
  # test drives Debian's chromium through Playwright from PyPI, since `playwright install`
  # downloads a browser of its own from outside the package registries.
  case ",$EXTRAS," in
    *,browser,*) [ -x /usr/bin/chromium ] || PACKAGES+=(chromium) ;;
  esac
fi
if ! venv_ok; then
  if ! command -v "$PY" >/dev/null 2>&1; then
    PACKAGES+=(python3 python3-venv)
  elif ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    read -r PYVER PYBASE < <("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2], sys.base_prefix)')
    [ "$PYBASE" = /usr ] || die "$PY has no venv/ensurepip module; give setup another PYTHON"
    PACKAGES+=("python$PYVER-venv")
  fi
fi
if [ ${#PACKAGES[@]} -gt 0 ]; then
  if [ $PRINT_PYTHON = 1 ]; then
    die "--print-python installs nothing, and the environment needs ${PACKAGES[*]}; run setup"
  elif command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    step "apt-get update" $SUDO apt-get update -qq
    step "apt packages: ${PACKAGES[*]}" $SUDO apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
  else
    echo "setup: no apt-get to install ${PACKAGES[*]}; without etcd the registry tests" \
      "fail under CI=true, without a compiler the CPU kernels stay off" >&2
  fi
fi

if ! venv_ok; then
  [ -e "$VENV" ] && echo "setup: remaking $VENV (not a working environment of $PY)" >&2
  step "virtual environment $VENV" "$PY" -m venv --clear "$VENV" >&2 ||
    die "could not make a virtual environment with $PY"
  venv_ok || die "$VENV is not a working virtual environment of $PY"
fi
refuse_unless_venv "$VPY"
if [ $PRINT_PYTHON = 1 ]; then
  echo "$VPY"
  exit 0
fi

# An unpinned torch resolves to a multi-GB CUDA build; without a GPU take the CPU one.
CONSTRAINTS=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  CONSTRAINTS=(-c constraints-cpu.txt)
  step "torch (CPU build)" install_cpu_torch || die "torch's CPU build did not install"
fi
step "omniflow and its Python deps (.[${EXTRAS}])" \
  "$VPY" -m pip install -q --disable-pip-version-check "${CONSTRAINTS[@]}" -e ".[${EXTRAS}]" rust-just
# The SGLang engine backend (engine/sglang_backend.py), when OMNIFLOW_SGLANG is set (CI sets
# cpu). gpu: the extra `sglang` (SGLang with its CUDA torch and sgl-kernel). cpu: SGLang
# without its deps (they would replace torch with a CUDA build), then the pure-Python ones
# its imports need and the CPU-safe binaries it imports at module level, torch held at the
# CPU build. Never torchvision here; a CPU machine also lacks sgl_kernel: the engine config
# says so, and the tests stand in for both (tests/engine/sglang_stubs).
SGLANG_CPU=(sglang==0.5.23 triton==3.8.0 apache-tvm-ffi==0.1.11 xgrammar==0.2.7)
# Its own deps pinned at the versions CI last resolved (a release of any of them may break
# SGLang's imports); those omniflow installs too (pyzmq, msgspec, pillow, uvicorn, uvloop,
# openai, transformers) are left as the main install resolved them.
SGLANG_CPU_DEPS=(orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 starlette==1.10.0
  IPython==9.18.1 aiohttp==3.14.5 dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1
  gguf==0.19.0 partial_json_parser==0.2.1.1.post7 fastapi==0.165.0 einops==0.8.2
  setproctitle==1.3.8 pyzmq msgspec pillow uvicorn uvloop openai transformers)
case "${OMNIFLOW_SGLANG:-}" in
  "") ;;
  cpu)
    SGLANG_START=$SECONDS
    "$VPY" -m pip install -q --disable-pip-version-check --no-deps "${SGLANG_CPU[@]}"
    "$VPY" -m pip install -q --disable-pip-version-check -c constraints-cpu.txt "${SGLANG_CPU_DEPS[@]}"
    "$VPY" -c 'import torch; assert torch.version.cuda is None, torch.__version__' ||
      die "the SGLang CPU install replaced torch with a CUDA build"
    echo "setup: sglang (CPU, no kernels) installed in $((SECONDS - SGLANG_START))s"
    ;;
  gpu)
    "$VPY" -m pip install -q --disable-pip-version-check -e ".[sglang]"
    ;;
  *) die "OMNIFLOW_SGLANG must be cpu or gpu, not ${OMNIFLOW_SGLANG}" ;;
esac
# Intel OpenMP (libiomp5 in $VENV/lib), which the supervisor preloads into workers with
# tcmalloc (omniflow/runtime/preload.py; OMNIFLOW_PRELOAD=0 turns it off). x86-64 only.
if [ "$(uname -m)" = x86_64 ]; then
  step "intel-openmp" "$VPY" -m pip install -q --disable-pip-version-check intel-openmp ||
    echo "setup: intel-openmp did not install; workers keep libgomp" >&2
fi
# Build the CPU kernels now rather than in the first engine that wants them.
echo "setup: CPU kernels ..." >&2
KERNELS_START=$SECONDS
KERNELS=$("$VPY" -c 'from omniflow.kernels import cpu_kernels, unavailable_reason as why
print("built" if cpu_kernels() else f"off ({why()})")')
echo "setup: CPU kernels: $KERNELS in $((SECONDS - KERNELS_START))s" >&2
echo "setup: done in $VENV ($("$VPY" -c 'import torch; print("torch", torch.__version__)'), $(etcd --version 2>/dev/null | head -1), CPU kernels $KERNELS)"
ACTIVATE="$VENV/bin/activate"
[ "$CALLER_DIR" = "$PWD" ] && ACTIVATE=${ACTIVATE#"$PWD"/}
echo "setup: \`. $ACTIVATE\` puts omniflow and just on PATH in this shell;" \
  "just recipes use the environment either way"
