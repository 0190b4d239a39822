"""Wire codec: headers round-trip, tensors travel out of band, no pickle."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from omniflow.messages import Call, Done, Fail, Frame
from omniflow.transport.codec import BadMessage, decode, encode, export_tensors, materialize_tensors
from omniflow.transport.tensors import TensorError, materialize

CASES = {
    "bf16": torch.randn(4, 5).to(torch.bfloat16),
    "f16": torch.randn(3, 7, dtype=torch.float16),
    "f32": torch.randn(2, 3, 4),
    "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "noncontig": torch.randn(6, 8)[:, ::2],
    "transposed": torch.randn(5, 3).t(),
    "empty": torch.empty(0, 4),
    "scalar": torch.tensor(3.25),
    "bool": torch.tensor([True, False, True]),
    "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
}


def roundtrip(msg, tensors):
    frames = [b""]
    msg.tensors = export_tensors(tensors, frames)
    frames[0] = encode(msg)
    # What ZeroMQ delivers: each frame's bytes, separately.
    wire = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]
    got = decode(wire[0])
    return got, materialize_tensors(got.tensors, wire), len(frames)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_round_trip_is_bit_exact(name):
    value = CASES[name]
    msg = Call("r", "role", "ipc://x", data={"k": [1, "a", None, 2.5]})
    got, tensors, nframes = roundtrip(msg, {"t": value})
    assert nframes == 2  # the header and one frame for the tensor
    assert isinstance(got.tensors["t"], Frame)
    expected = torch.as_tensor(value)
    assert tensors["t"].dtype == expected.dtype
    assert tensors["t"].shape == expected.shape
    assert torch.equal(tensors["t"], expected)
    assert got.data == {"k": [1, "a", None, 2.5]}


def test_many_tensors_one_frame_each():
    msg = Call("r", "role", "ipc://x")
    got, tensors, nframes = roundtrip(msg, {k: CASES[k] for k in ("f32", "i64", "bf16")})
    assert nframes == 4
    assert sorted(tensors) == ["bf16", "f32", "i64"]


def test_no_pickle_for_unknown_types():
    class Thing:
        pass

    with pytest.raises(TypeError, match="cannot put a Thing on the wire"):
        encode(Call("r", "role", "ipc://x", data={"x": Thing()}))


def test_garbage_is_a_bad_message():
    for junk in (b"", b"\xff\x00", msgspec.msgpack.encode(["nope", 1]), b"\x93\x01\x02"):
        with pytest.raises(BadMessage):
            decode(junk)


def test_terminal_messages_round_trip():
    for msg in (Done("r", "a", 5, usage={"cached_tokens": 3}), Fail("deadline", "late", "a", "r")):
        assert decode(encode(msg)) == msg


def test_inconsistent_frame_ref_is_rejected_not_read():
    frames = [b"", b"\x00" * 10]
    with pytest.raises(TensorError, match="needs 16"):
        materialize(Frame(1, "float32", (4,)), frames)
    with pytest.raises(TensorError, match="outside"):
        materialize(Frame(5, "float32", (4,)), frames)
    with pytest.raises(TensorError, match="unknown dtype"):
        materialize(Frame(1, "complex512", (1,)), frames)
