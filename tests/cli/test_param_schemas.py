"""Each shipped role declares the request parameters it reads; a wrong one is bad_request."""

from __future__ import annotations

import pytest

from omniflow.roles.options import MAKES, PARAMS, EchoParams, LLMParams, read_params
from omniflow.runtime.actor import BadRequest
from omniflow.runtime.loading import load_actor_class, makes_of, params_type
from tests.roles.test_options import _shipped_actors


def test_the_listed_params_are_what_each_role_declares():
    for path, struct in PARAMS.items():
        assert load_actor_class(path).Params is struct, path
    for path, cls in _shipped_actors().items():
        assert params_type(path) is cls.Params, path


def test_the_listed_outputs_are_what_each_role_declares():
    for path, cls in _shipped_actors().items():
        assert makes_of(path) == cls.Makes == MAKES.get(path, ()), path


@pytest.mark.parametrize(
    ("params", "field", "expected"),
    [
        ({"cfg_scale": "abc"}, "params.cfg_scale", "Expected `float`, got `str`"),
        ({"image_grid": [2, 40]}, "params.image_grid[1]", "Expected `int` <= 32"),
        ({"max_tokens": 0}, "params.max_tokens", "Expected `int` >= 1"),
        ({"audio_chunks": 1.5}, "params.audio_chunks", "Expected `int`, got `float`"),
    ],
)
def test_llm_params_name_the_key_that_is_wrong(params, field, expected):
    with pytest.raises(BadRequest) as caught:
        read_params(LLMParams, {"text": "ignored: not a param of mine", **params})
    assert caught.value.field == field
    assert expected in str(caught.value)


def test_read_params_takes_only_its_own_keys_and_converts_them():
    got = read_params(LLMParams, {"cfg_scale": 3, "delay_ms": "other role's"})
    assert got.cfg_scale == 3.0 and isinstance(got.cfg_scale, float)
    assert read_params(EchoParams, {"cfg_scale": "x", "delay_ms": 5}).delay_ms == 5.0
