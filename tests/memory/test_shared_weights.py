"""One copy of a model's weights in the host pool, mapped by every process that loads it.

Sharing is proven from the kernel's maps of each process (/proc/<pid>/maps), not from
anything the code under test reports about itself.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.engine.llm_engine import EngineConfig, LLMEngine
from omniflow.engine.sampling_params import SamplingParams
from omniflow.memory import PagePool
from omniflow.memory.mappings import mapping_at, mapping_of
from omniflow.memory.weights import SharedWeights, TensorSpec, share_checkpoint
from omniflow.models.loader import load_decoder
from omniflow.models.tiny.builder import build_tiny_model
from tests.memory.pool_workers import SPAWN
from tests.memory.weights_workers import die_while_loading, load_and_hold, logits_of


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return build_tiny_model(tmp_path / "tiny", "llama-gqa")


def private_logits(path: Path) -> torch.Tensor:
    model = load_decoder(path, dtype="float32")
    model.use_input_major_weights()  # the layout the engine gives a private model on CPU
    return logits_of(model)


def manifests(pool: PagePool) -> list[str]:
    folder, name = os.path.split(pool.path)
    return [f for f in os.listdir(folder) if f.startswith(f"{name}@") and f.endswith(".json")]


def pages(pool: PagePool) -> int:
    return pool.stats().used_pages


def test_two_processes_loading_at_once_map_one_copy_freed_after_kill_and_close(
    pool: PagePool, tiny: Path
) -> None:
    start = pages(pool)
    go = SPAWN.Event()
    ends, procs = [], []
    for _ in range(2):
        ours, theirs = SPAWN.Pipe()
        proc = SPAWN.Process(target=load_and_hold, args=(pool.name, str(tiny), go, theirs))
        proc.start()
        ends.append(ours)
        procs.append(proc)
    try:
        go.set()
        results = [end.recv() for end in ends]
        (pid_a, at_a, logits_a, nbytes, _), (pid_b, at_b, logits_b, _, _) = results
        # Every tensor of both processes lies at the same offset of the pool's segment file.
        where_a = {name: mapping_at(address, pid_a) for name, address in at_a.items()}
        where_b = {name: mapping_at(address, pid_b) for name, address in at_b.items()}
        assert where_a == where_b
        assert {m.path for m in where_a.values()} == {pool.path}
        assert len({m.offset for m in where_a.values()}) == len(where_a)
        # One copy in the pool: the model's bytes (plus alignment), not two of them.
        param_bytes = sum(
            p.numel() * p.element_size() for p in load_decoder(tiny, dtype="float32").parameters()
        )
        assert param_bytes <= nbytes < param_bytes + 64 * len(at_a)
        assert pages(pool) - start == -(-nbytes // pool.page_size)
        assert sorted(created for *_, created in results) == [False, True]
        expected = private_logits(tiny).numpy()
        assert (logits_a == expected).all() and (logits_b == expected).all()

        # kill -9 one holder, close the other: the block is freed once the dead pid is
        # reclaimed (the supervisor's job; this test plays it).
        os.kill(pid_a, signal.SIGKILL)
        procs[0].join(10)
        ends[1].send("close")
        assert ends[1].recv() == "closed"
        assert pages(pool) - start == -(-nbytes // pool.page_size)
        assert pool.reclaim({pid_a}).leases_freed == 1
        assert pages(pool) == start
    finally:
        for end in ends[1:]:
            end.send("exit")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    # The manifest left behind names a freed block: the next load makes a new copy.
    assert len(manifests(pool)) == 1
    with SharedWeights(pool, tiny) as weights:
        model = load_decoder(tiny, dtype="float32", place=weights.place)
        assert weights.created
        assert torch.equal(logits_of(model), private_logits(tiny))
    assert pages(pool) == start and manifests(pool) == []


def test_changed_checkpoint_gets_a_new_copy_not_the_stale_one(pool: PagePool, tiny: Path) -> None:
    start = pages(pool)
    old = SharedWeights(pool, tiny)
    old_model = load_decoder(tiny, dtype="float32", place=old.place)
    old_logits = logits_of(old_model)
    one_copy = pages(pool) - start
    build_tiny_model(tiny, "llama-gqa", seed=1)  # rewritten in place: other weights
    new = SharedWeights(pool, tiny)
    new_model = load_decoder(tiny, dtype="float32", place=new.place)
    assert new.created and new.lease != old.lease
    assert pages(pool) - start == 2 * one_copy
    embed = "model.embed_tokens.weight"
    old_at, new_at = (mapping_of(m.get_parameter(embed)) for m in (old_model, new_model))
    assert old_at.path == new_at.path == pool.path and old_at.offset != new_at.offset
    assert torch.equal(logits_of(new_model), private_logits(tiny))
    assert torch.equal(logits_of(old_model), old_logits)  # the old holder is untouched
    assert not torch.equal(old_logits, logits_of(new_model))
    old.close()
    new.close()
    assert pages(pool) == start


def test_prefix_shares_the_backbone_and_loads_the_rest_privately(
    pool: PagePool, tiny: Path
) -> None:
    first, second = (SharedWeights(pool, tiny, prefix="model.layers.") for _ in range(2))
    models = [load_decoder(tiny, dtype="float32", place=w.place) for w in (first, second)]
    assert (first.created, second.created) == (True, False)
    for name, _ in models[0].named_parameters():
        a, b = (mapping_of(m.get_parameter(name)) for m in models)
        if name.startswith("model.layers."):
            assert a == b and a.path == pool.path
        else:  # embeddings, final norm, lm_head: each process's own
            assert pool.path not in (a.path, b.path)
    expected = private_logits(tiny)
    assert all(torch.equal(logits_of(m), expected) for m in models)
    first.close()
    second.close()


@pytest.mark.parametrize(
    "preset", ["qwen2-tied-odd-heads", "deepseek-v2-tiny", "longcat-flash-tiny"]
)
def test_every_architecture_maps_one_copy_with_private_logits(
    pool: PagePool, tmp_path: Path, preset: str
) -> None:
    path = build_tiny_model(tmp_path / preset, preset)
    first, second = SharedWeights(pool, path), SharedWeights(pool, path)
    models = [load_decoder(path, dtype="float32", place=w.place) for w in (first, second)]
    assert (first.created, second.created) == (True, False)
    tensors = [m.state_dict(keep_vars=True) for m in models]
    for name, tensor in tensors[0].items():
        assert mapping_of(tensor) == mapping_of(tensors[1][name])
        assert mapping_of(tensor).path == pool.path
    expected = private_logits(path)
    assert all(torch.equal(logits_of(m), expected) for m in models)
    first.close()
    second.close()
    assert pool.stats().used_pages == 0


def test_engine_on_shared_weights_keeps_them_and_generates_as_a_private_one(
    pool: PagePool, tiny: Path
) -> None:
    def generate(model: torch.nn.Module | Path) -> list[int]:
        config = EngineConfig(device="cpu", dtype="float32", num_pages=16, max_num_seqs=2)
        engine = LLMEngine(model, config)
        engine.add_request("r", [1, 7, 42, 9], SamplingParams(temperature=0, max_tokens=6))
        tokens = [t for delta in engine.run_to_completion() for t in delta.token_ids]
        engine.close()
        return tokens

    with SharedWeights(pool, tiny) as weights:
        model = load_decoder(tiny, dtype="float32", place=weights.place)
        assert generate(model) == generate(tiny)
        assert {mapping_of(p).path for p in model.parameters()} == {pool.path}


def test_engine_relayouts_leave_shared_weights_in_the_pool(pool: PagePool, tiny: Path) -> None:
    with SharedWeights(pool, tiny) as weights:
        model = load_decoder(tiny, dtype="bfloat16", place=weights.place)
        before = {n: mapping_of(p) for n, p in model.named_parameters()}
        model.use_packed_weights()
        model.use_input_major_weights()
        assert not model.packed
        assert {n: mapping_of(p) for n, p in model.named_parameters()} == before
        assert {m.path for m in before.values()} == {pool.path}


def test_share_checkpoint_gives_a_state_dict_of_pool_views(pool: PagePool, tiny: Path) -> None:
    on_disk = load_file(str(tiny / "model.safetensors"))
    with share_checkpoint(pool, tiny, prefix="model.layers.1.") as a:
        with share_checkpoint(pool, tiny, prefix="model.layers.1.") as b:
            assert sorted(a.tensors) == sorted(
                n for n in on_disk if n.startswith("model.layers.1.")
            )
            assert (a.created, b.created, a.lease) == (True, False, b.lease)
            for name, view in a.tensors.items():
                assert torch.equal(view, on_disk[name])
                assert mapping_of(view) == mapping_of(b.tensors[name])
                assert mapping_of(view).path == pool.path
        with share_checkpoint(pool, tiny, prefix="model.layers.1.", dtype=torch.bfloat16) as c:
            assert c.lease != a.lease  # another dtype: another copy
            assert all(t.dtype == torch.bfloat16 for t in c.tensors.values())


def test_loader_killed_mid_copy_publishes_nothing_and_frees_on_reclaim(
    pool: PagePool, tiny: Path
) -> None:
    start = pages(pool)
    proc = SPAWN.Process(target=die_while_loading, args=(pool.name, str(tiny)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert pages(pool) > start and manifests(pool) == []  # its block, held by a dead pid
    specs = [TensorSpec(f"t{i}", "float32", (1024,), (1,)) for i in range(4)]
    with SharedWeights(pool, tiny, tag="die") as weights:  # the lock died with it
        views = weights.load(specs, lambda views: [v.fill_(2.0) for v in views.values()])
        assert weights.created and all(bool((v == 2.0).all()) for v in views.values())
        assert pool.reclaim({proc.pid}).leases_freed == 1
    assert pages(pool) == start


def test_bad_requests_name_the_field(pool: PagePool, tiny: Path) -> None:
    with pytest.raises(ValueError, match="prefix"):
        load_decoder(tiny, place=SharedWeights(pool, tiny, prefix="vision.").place)
    with pytest.raises(ValueError, match="device"):
        load_decoder(tiny, device="cuda", place=SharedWeights(pool, tiny).place)
    with pytest.raises(FileNotFoundError, match="source"):
        share_checkpoint(pool, tiny / "absent")


def test_share_checkpoint_reads_the_shards_its_index_names(pool: PagePool, tiny: Path) -> None:
    """Shards by the index file: a stray .safetensors beside them (an old consolidated copy)
    is not the model's and is never read."""
    on_disk = load_file(str(tiny / "model.safetensors"))
    names = sorted(on_disk)
    half = len(names) // 2
    save_file({n: on_disk[n] for n in names[:half]}, str(tiny / "model-00001-of-00002.safetensors"))
    save_file({n: on_disk[n] for n in names[half:]}, str(tiny / "model-00002-of-00002.safetensors"))
    weight_map = {
        n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)
    }
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tiny / "model.safetensors").rename(tiny / "consolidated.safetensors")
    save_file({"stray.weight": torch.ones(3)}, str(tiny / "consolidated.safetensors"))
    with share_checkpoint(pool, tiny) as shared:
        assert sorted(shared.tensors) == names
        assert all(torch.equal(shared.tensors[n], on_disk[n]) for n in names)
    (tiny / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names shards that are absent"):
        share_checkpoint(pool, tiny)
