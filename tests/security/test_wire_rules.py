"""Each rule of the wire protocol, refused by a targeted message to a live actor."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import msgspec
import pytest
import torch

import omniflow
from omniflow import messages
from omniflow.memory.pool import received
from omniflow.messages import Call, Fail, Frame, Shm
from omniflow.transport import codec
from omniflow.transport.codec import BadMessage, decode, encode

PACKAGE = Path(omniflow.__file__).parent
_EXECUTING = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}


def test_no_module_of_omniflow_imports_a_code_executing_serializer() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
                names = [getattr(a, "value", "") for a in node.args[:1]]
            found += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n in _EXECUTING]
    assert found == []


def _leaf_types(info: msgspec.inspect.Type, seen: set[int]) -> list[type]:
    """Every leaf type a decoder for ``info`` can produce."""
    if id(info) in seen:
        return []
    seen.add(id(info))
    if isinstance(info, msgspec.inspect.StructType):
        return [t for f in info.fields for t in _leaf_types(f.type, seen)]
    kids = [getattr(info, a) for a in ("item_type", "key_type", "value_type") if hasattr(info, a)]
    kids += list(getattr(info, "types", ())) + list(getattr(info, "item_types", ()))
    if kids:
        return [t for k in kids for t in _leaf_types(k, seen)]
    return [type(info)]


def test_every_wire_type_decodes_to_plain_data_only() -> None:
    infos = msgspec.inspect.multi_type_info([messages.Message, messages.ActorRecord])
    leaves = {t for info in infos for t in _leaf_types(info, set())}
    plain = {
        msgspec.inspect.StrType,
        msgspec.inspect.IntType,
        msgspec.inspect.FloatType,
        msgspec.inspect.BoolType,
        msgspec.inspect.NoneType,
        msgspec.inspect.BytesType,
        msgspec.inspect.AnyType,  # data/params dicts: plain msgpack, extensions refused
    }
    assert leaves <= plain, leaves - plain
    with pytest.raises(BadMessage, match="extension type 1"):
        decode(msgspec.msgpack.encode(Call("r", "x", "", data={"a": msgspec.msgpack.Ext(1, b"")})))


def _header(msg: Call) -> list:
    return msgspec.msgpack.decode(encode(msg))


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda h: ["exec", *h[1:]], "Invalid value 'exec'"),
        (lambda h: [*h, *[0] * 30], "at most length"),  # fields the Call does not declare
        (lambda h: h[:1], "at least length"),  # truncated
        (lambda h: [h[0], 5, *h[2:]], "Expected `str`"),
        (lambda h: {"type": "call"}, "Expected `array`"),
    ],
)
def test_malformed_headers_are_bad_messages(mutate, error) -> None:
    header = msgspec.msgpack.encode(mutate(_header(Call("r", "check", "ipc://x"))))
    with pytest.raises(BadMessage, match=error):
        decode(header)


def test_header_past_the_limit_is_refused_before_decoding(monkeypatch) -> None:
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(BadMessage, match="exceeds 1000"):
        decode(encode(Call("r", "check", "ipc://x", data={"t": "x" * 2000})))


def test_nesting_too_deep_is_a_bad_message() -> None:
    # a Call whose data = {"d": [[[[...]]]]}, 200,000 levels deep
    head = b"\x95\xa4call\xa1r\xa5check\xa0\x81\xa1d"
    with pytest.raises(BadMessage, match="nested too deep"):
        decode(head + b"\x91" * 200_000 + b"\xc0")


@pytest.mark.parametrize(
    "ref, error",
    [
        ({"type": "frame", "index": 1, "dtype": "float32", "shape": [1] * 17}, "length <= 16"),
        ({"type": "frame", "index": 1, "dtype": "float32", "shape": [-1]}, ">= 0"),
        ({"type": "frame", "index": 0, "dtype": "float32", "shape": [1]}, ">= 1"),
        ({"type": "frame", "index": 1, "dtype": "float32", "shape": [1], "x": 1}, "unknown field"),
        ({"type": "shm", "offset": -1, "nbytes": 4, "dtype": "float32", "shape": []}, ">= 0"),
        ({"type": "pickle", "index": 1}, "Invalid value 'pickle'"),
    ],
)
def test_bad_tensor_refs_are_refused_by_the_decoder(ref, error) -> None:
    header = _header(Call("r", "check", "ipc://x"))
    header[5] = {"x": ref}  # [tag, request_id, role, reply_to, data, tensors, ...]
    with pytest.raises(BadMessage, match=error):
        decode(msgspec.msgpack.encode(header))


def _frame_call(frames: int, refs: dict) -> tuple[Call, list]:
    call = Call("r", "check", "ipc://x", tensors=refs)
    return call, [encode(call), *[b"\0" * 8] * frames]


@pytest.mark.parametrize(
    "frames, refs, error",
    [
        (2, {"x": Frame(1, "float32", (2,))}, "1 named by tensors"),  # an unreferenced frame
        (1, {"x": Frame(1, "float32", (2,)), "y": Frame(1, "float32", (2,))}, "taken"),
        (1, {"x": Frame(2, "float32", (2,))}, "missing"),
        (1, {"x": Frame(1, "float32", (3,))}, "holds 8 bytes"),
        (1, {"x": Frame(1, "complex64", (1,))}, "unknown dtype"),
        (1, {"x": Frame(1, "float32", (1 << 40, 1 << 40))}, "more than"),
    ],
)
def test_frames_must_match_their_refs(frames, refs, error) -> None:
    call, parts = _frame_call(frames, refs)
    with pytest.raises(BadMessage, match=error):
        codec.check_parts(call, parts)


def test_too_many_frames_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(codec, "MAX_FRAMES", 4)
    call, parts = _frame_call(4, {})
    with pytest.raises(BadMessage, match="5 frames, more than 4"):
        codec.check_parts(call, parts)


# ------------------------------------------------------------ against a live actor


def test_a_malformed_header_is_answered_on_the_sending_socket(live, probe) -> None:
    probe.send([b"\xc1 not msgpack"])
    fail = probe.reply()
    assert isinstance(fail, Fail) and fail.code == "bad_request"
    assert "malformed message header" in fail.message and fail.role == "check"
    assert probe.served()


def test_a_frame_mismatch_is_a_bad_request_fail(live, probe) -> None:
    rid = probe.request_id()
    fail = probe.call(rid, {"x": Frame(1, "float32", (4,))}, [b"\0" * 8])
    assert isinstance(fail, Fail) and fail.code == "bad_request"
    assert f"request {rid!r}" in fail.message and "tensors['x']" in fail.message
    assert probe.served()


def _held_block(live, pid: int) -> Shm:
    """A one-page block of float32 ones in the deployment's pool, a ref shared to ``pid``
    (as a sender's export takes it)."""
    t, lease = live.pool.empty((16,), torch.float32)
    t.fill_(1.0)
    ref = live.pool.share(t, received(pid))
    lease.release()
    return ref


def _used(live) -> int:
    return live.pool.stats().used_pages


@pytest.mark.parametrize(
    "forge, error",
    [
        (lambda ref, pool: msgspec.structs.replace(ref, offset=pool.size), "outside pool"),
        (lambda ref, pool: msgspec.structs.replace(ref, pool="another-deployment"), "another"),
        (lambda ref, pool: msgspec.structs.replace(ref, lease=ref.lease + (1 << 24)), "not live"),
        (lambda ref, pool: msgspec.structs.replace(ref, offset=ref.offset + 65536), "not inside"),
    ],
)
def test_forged_shm_refs_are_bad_requests(live, probe, forge, error) -> None:
    before = _used(live)
    ref = _held_block(live, live.replica.proc.pid)
    fail = probe.call(probe.request_id(), {"x": forge(ref, live.pool)}, [])
    assert isinstance(fail, Fail) and fail.code == "bad_request", fail
    assert error in fail.message and "rejected Shm ref" in fail.message
    assert probe.served()
    # The actor gave back the ref it held when the forged one kept the genuine lease;
    # a forged lease it cannot release, so the genuine ref is still there.
    if live.pool.refs(ref.lease):
        live.pool.release(ref.lease, received(live.replica.proc.pid))
    assert _used(live) == before


def test_a_ref_the_sender_never_shared_with_the_actor_is_refused(live, probe) -> None:
    before = _used(live)
    mine = _held_block(live, os.getpid())  # held for this process, not the actor
    fail = probe.call(probe.request_id(), {"x": mine}, [])
    assert isinstance(fail, Fail) and fail.code == "bad_request"
    assert "holds no ref for pid" in fail.message
    assert live.pool.holders(mine.lease) == {received(os.getpid()): 1}  # the actor took nothing
    live.pool.release(mine.lease, received(os.getpid()))
    assert probe.served() and _used(live) == before


def test_a_refused_ref_never_releases_an_own_or_anonymous_ref(live, probe) -> None:
    """A forged ref naming a lease the actor holds for itself (as its encoder cache does)
    or one held anonymously: refused, and each keeps its ref (no release falls back to
    the receiver's own refs or to anonymous ones)."""
    before = _used(live)
    pid = live.replica.proc.pid
    t, lease = live.pool.empty((16,), torch.float32)
    own = live.pool.share(t, pid)  # the actor's own hold, not shared to it
    anon = live.pool.share(t, 0)
    lease.release()
    for forged in (own, anon):
        extra = {"y": Frame(1, "float32", (2,))}  # and a bad frame: the message is dropped
        for tensors, frames in (({"x": forged}, []), ({"x": forged, **extra}, [b"short"])):
            fail = probe.call(probe.request_id(), tensors, frames)
            assert isinstance(fail, Fail) and fail.code == "bad_request", fail
    assert live.pool.holders(own.lease) == {pid: 1, 0: 1}, live.pool.holders(own.lease)
    live.pool.release(own.lease, pid)
    live.pool.release(own.lease, 0)
    assert probe.served() and _used(live) == before


def test_a_replayed_shm_ref_is_refused_and_the_original_served(live, probe) -> None:
    before = _used(live)
    ref = _held_block(live, live.replica.proc.pid)
    first = probe.call(probe.request_id(), {"x": ref}, [])
    assert first.data == {"sum": 16.0, "in_pool": True, "n": 16}
    again = probe.call(probe.request_id(), {"x": ref}, [])  # the block was released and freed
    assert isinstance(again, Fail) and again.code == "bad_request" and "not live" in again.message
    assert probe.served() and _used(live) == before


def test_stale_generation_is_refused_after_the_slot_is_reused(live, probe) -> None:
    before = _used(live)
    pid = live.replica.proc.pid
    old = _held_block(live, pid)
    live.pool.release(old.lease, received(pid))
    new = _held_block(live, pid)  # same slot and pages, next generation
    assert (new.offset, new.lease & 0xFFFFFF) == (old.offset, old.lease & 0xFFFFFF)
    fail = probe.call(probe.request_id(), {"x": old}, [])
    assert isinstance(fail, Fail) and "not live" in fail.message
    live.pool.release(new.lease, received(pid))
    assert probe.served() and _used(live) == before


# ------------------------------------------------------------ owner-only files


def test_pool_segment_is_0600_and_run_dir_and_sockets_owner_only(live) -> None:
    run_dir = live.rt.supervisor.run_dir
    assert stat.S_IMODE(os.stat(live.pool.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    socks = [s for s in Path(run_dir).glob("*.sock") if not s.name.startswith("probe-")]
    assert socks and [s.name for s in socks if stat.S_IMODE(s.stat().st_mode) & 0o077] == []


def test_a_run_dir_left_open_to_others_is_refused_naming_it(tmp_path) -> None:
    # Issue 40: a folder others may write was made owner-only before; someone else may
    # already have planted files in it, so it is refused, named, and left as it is.
    from omniflow.transport.endpoint import private_dir
    from omniflow.transport.security import UntrustedPath

    loose = tmp_path / "run"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    with pytest.raises(UntrustedPath, match=str(loose)):
        private_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o777
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(PermissionError, match="link"):
        private_dir(link)


def test_a_replayed_request_id_is_a_bad_request(live, probe) -> None:
    assert probe.served()
    rid = probe.last_request_id()  # the one just served
    fail = probe.call(rid, {"x": Frame(1, "float32", (1,))}, [b"\0" * 4])
    assert isinstance(fail, Fail) and fail.code == "bad_request" and "already ended" in fail.message
    assert probe.served()


def test_a_detached_up_makes_its_run_root_and_run_dir_owner_only(
    run_root, tmp_path, monkeypatch
) -> None:
    # `up --detach` made the run dir with mkdir(parents=True): a run root it created was
    # 0755, so another user could list the deployments in it.
    from tests.helpers import cli

    root = run_root / "fresh"
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", str(root))
    (tmp_path / "d.toml").write_text(
        'name = "detach0700"\n[roles.upper]\nactor = "omniflow.roles.echo:Upper"\n'
        '[graph]\nedges = [{ from = "input", to = "upper" }]\n'
    )
    cli("up", str(tmp_path / "d.toml"), "--detach", timeout=120)
    try:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE((root / "detach0700").stat().st_mode) == 0o700
    finally:
        cli("down", "--name", "detach0700", check=False)
