"""GPU placement and the CPU side of GPU support, on a machine with or without a GPU:
CUDA_VISIBLE_DEVICES per replica from ``gpus`` (read back from the spawned workers),
no CUDA library in CPU roles, ``device = "cuda"`` refused without a GPU, Hunyuan's
CUDA + lend_kv refused at load, the LLM role's embedding hash on any tensor type."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniflow.memory.pinned import cuda_available
from omniflow.roles.llm_prompt import _tensor_hash
from omniflow.runtime.config import ConfigError, parse
from omniflow.runtime.gpus import device_problem, placement_env, replica_gpus

ROOT = Path(__file__).resolve().parents[2]

ECHO_GPUS = """
name = "gpuplace"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
gpus = [3]
[roles.reverse]
actor = "omniflow.roles.echo:Reverse"
replicas = 2
gpus = [0, 1, 2, 5]
[graph]
edges = [{ from = "input", to = "upper" }, { from = "upper", to = "reverse" }]
[runtime]
start_timeout_s = 60
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_replica_gpus_split_and_share() -> None:
    assert replica_gpus([0, 1, 2, 3], 2, 1) == [2, 3]
    assert [replica_gpus([4, 7], 4, i) for i in range(4)] == [[4], [7], [4], [7]]
    assert replica_gpus([], 3, 2) == []
    with pytest.raises(ValueError, match="3 GPUs cannot be shared evenly by 2 replicas"):
        replica_gpus([0, 1, 2], 2, 0)
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "9"}
    placement_env(env, [], 1, 0)
    assert env == {"CUDA_VISIBLE_DEVICES": "9"}  # no gpus: the caller's environment stands
    placement_env(env, [6, 2], 1, 0)
    assert env == {"CUDA_VISIBLE_DEVICES": "6,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_each_spawned_replica_sees_its_gpus_and_cpu_roles_map_no_cuda(
    run_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "gpuplace.toml"
    config.write_text(ECHO_GPUS)

    def omniflow(*args: str) -> str:
        cmd = [sys.executable, "-m", "omniflow.cli", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    omniflow("up", str(config), "--detach")
    try:
        state = json.loads(omniflow("status", "--name", "gpuplace", "--json"))
        seen = {
            (a["role"], a["replica"]): _environ(a["pid"]).get("CUDA_VISIBLE_DEVICES")
            for a in state["actors"]
        }
        assert seen == {("upper", 0): "3", ("reverse", 0): "0,1", ("reverse", 1): "2,5"}
        assert "OLLEH" in omniflow("send", "--name", "gpuplace", "--text", "hello")
        for pid in [state["supervisor_pid"], *(a["pid"] for a in state["actors"])]:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libcuda" not in maps and "libcudart" not in maps, pid  # no CUDA context
    finally:
        omniflow("down", "--name", "gpuplace")


def _config(role_options: str, gpus: str = "[]") -> str:
    return f"""
name = "dev"
[roles.llm]
actor = "omniflow.roles.llm:LLMRole"
gpus = {gpus}
[roles.llm.options]
build_tiny = true
model_path = "/tmp/of-never-built"
{role_options}
[graph]
edges = [{{ from = "input", to = "llm" }}]
"""


@pytest.mark.skipif(cuda_available(), reason="this host has a GPU")
def test_cuda_device_without_a_gpu_is_a_config_error_naming_the_role() -> None:
    import msgspec

    raw = msgspec.toml.decode(_config('device = "cuda:1"'))
    with pytest.raises(ConfigError, match=r"\[roles\.llm\]: device = \"cuda:1\" but this host"):
        parse(raw, "dev.toml")
    parse(msgspec.toml.decode(_config('device = "cpu"', "[0]")), "dev.toml")  # gpus alone: fine


def test_cuda_ordinal_past_the_replica_share_is_refused() -> None:
    problem = device_problem({"device": "cuda:2"}, [4, 5], 1, gpu_present=True)
    assert "each replica sees 2 GPU(s) of gpus = [4, 5]" in problem
    assert device_problem({"device": "cuda:1"}, [4, 5], 1, gpu_present=True) == ""
    assert "cannot be shared evenly" in device_problem({}, [0, 1, 2], 2, gpu_present=False)


@pytest.mark.parametrize(
    ("actor", "options", "field"),
    [
        ("omniflow.roles.hunyuan_ar:ARRole", {}, "lend_kv"),
        ("omniflow.roles.hunyuan_diffusion:DiffusionRole", {}, "reuse_prefix"),
    ],
)
def test_hunyuan_on_cuda_with_lent_kv_is_refused_at_load(actor, options, field) -> None:
    import msgspec

    from omniflow.runtime.config import check_options
    from omniflow.runtime.tables import FieldError

    raw = {
        "name": "hy",
        "roles": {
            "r": {
                "actor": actor,
                "options": {"model_path": "/tmp/x", "build_tiny": True, "device": "cuda"},
            }
        },
        "graph": {"edges": [{"from": "input", "to": "r"}]},
    }
    from omniflow.runtime.config import Config
    from omniflow.runtime.tables import decode

    config = decode(raw, Config)
    with pytest.raises(FieldError) as err:
        check_options(config)
    text = str(err.value)
    assert f"[roles.r.options] {field}" in text and 'device = "cuda"' in text
    assert ("lend_kv" in text) and ("reuse_prefix" in text)  # both options named
    raw["roles"]["r"]["options"][field] = False
    check_options(msgspec.convert(raw, Config))  # the combination that works is accepted


class _Sub(torch.Tensor):
    pass


def test_embedding_hash_is_the_same_on_every_layout_and_type() -> None:
    base = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    assert _tensor_hash(base) == _tensor_hash(base.clone())
    assert _tensor_hash(base.t()) == _tensor_hash(base.t().contiguous())  # strided view
    assert _tensor_hash(base.as_subclass(_Sub)) == _tensor_hash(base)  # a subclass
    bf = base.to(torch.bfloat16)
    assert _tensor_hash(bf) == _tensor_hash(bf.clone()) != _tensor_hash(base)  # no numpy bf16
    assert _tensor_hash(base) != _tensor_hash(base.reshape(4, 6))  # the shape counts


@pytest.mark.gpu
def test_embedding_hash_of_a_cuda_tensor_equals_its_host_copy() -> None:
    base = torch.randn(33, 7, dtype=torch.bfloat16)
    assert _tensor_hash(base.cuda()) == _tensor_hash(base)
    assert _tensor_hash(base.cuda().t()) == _tensor_hash(base.t())
