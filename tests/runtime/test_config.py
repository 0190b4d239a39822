"""config.load checks a whole config, role options included, and names file, table, field."""

from __future__ import annotations

import re

import pytest

from omniflow.runtime.config import ConfigError, load
from tests.bad_configs import CASES, GOOD, write


def test_the_good_config_loads_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load(write(tmp_path, "", ""))
    assert config.roles["llm"].options["kv_cache_mb"] == 8
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("old, new, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_config_fails_at_load_naming_file_table_and_field(
    tmp_path, monkeypatch, old, new, message
):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, old, new)
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: {message}")):
        load(path)


def test_an_existing_relative_model_path_needs_no_build_tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llm").mkdir(parents=True)
    load(write(tmp_path, "build_tiny = true", ""))  # relative to the working directory
    monkeypatch.chdir(tmp_path / "models")
    with pytest.raises(ConfigError, match="does not exist; set build_tiny = true"):
        load(write(tmp_path, "build_tiny = true", ""))


def test_an_actor_without_options_struct_takes_any_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = GOOD.replace("omniflow.roles.echo:Upper", "tests.graph_roles:Encoder")
    path = tmp_path / "free.toml"
    path.write_text(text.replace("delay_ms = 1", 'anything = "goes"'))
    assert load(path).roles["upper"].options == {"anything": "goes"}
