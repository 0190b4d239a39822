#!/usr/bin/env bash
# Set up omniflow on a fresh Debian/Ubuntu machine: Python deps (CPU torch unless a GPU
# is present), `just`, the etcd server that the registry tests start, and a C compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${OMNIFLOW_EXTRAS:-dev,etcd}

# Debian packages: the etcd server the registry tests start, and a C compiler for
# omniflow's CPU kernels (without one the engine keeps PyTorch ops). One apt run for both.
PACKAGES=()
command -v etcd >/dev/null 2>&1 || PACKAGES+=(etcd-server)
command -v cc >/dev/null 2>&1 || PACKAGES+=(gcc libc6-dev)
if [ ${#PACKAGES[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
  else
    echo "setup: no apt-get to install ${PACKAGES[*]}; without etcd the registry tests" \
      "fail under CI=true, without a compiler the CPU kernels stay off" >&2
  fi
fi

# An unpinned torch resolves to a multi-GB CUDA build; without a GPU take the CPU one.
CONSTRAINTS=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  CONSTRAINTS=(-c constraints-cpu.txt)
fi
$PY -m pip install -q --disable-pip-version-check "${CONSTRAINTS[@]}" -e ".[${EXTRAS}]" rust-just
# Build the CPU kernels now rather than in the first engine that wants them.
KERNELS=$($PY -c 'from omniflow.kernels import cpu_kernels, unavailable_reason as why
print("built" if cpu_kernels() else f"off ({why()})")')
echo "setup: done ($($PY -c 'import torch; print("torch", torch.__version__)'), $(etcd --version 2>/dev/null | head -1), CPU kernels $KERNELS)"
