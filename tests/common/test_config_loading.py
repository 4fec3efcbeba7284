"""Configuration: building a role's config from values, and reading them from a TOML file."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from qmq.common.config import (
    BrokerConfig,
    MetaConfig,
    StandaloneConfig,
    build_config,
    field_docs,
    load_toml_section,
    merged,
)
from qmq.common.errors import ConfigError

CONFIG_CLASSES = [BrokerConfig, MetaConfig, StandaloneConfig]


@dataclass
class Toy:
    """A config with the field types the roles' configs do not use (yet)."""

    verbose: bool = False
    mode: Literal["a", "b"] = "a"


@dataclass
class Unsupported:
    names: list[str] = dataclasses.field(default_factory=list)


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
def test_no_values_give_the_defaults(cls: type[Any]) -> None:
    assert build_config(cls, {}) == cls()


@pytest.mark.parametrize("cls", CONFIG_CLASSES)
def test_every_default_passes_its_own_checks_and_has_a_doc(cls: type[Any]) -> None:
    defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}

    assert build_config(cls, defaults) == cls()
    assert all(field_docs(cls).values())


def test_values_are_taken_and_strings_coerced() -> None:
    cfg = build_config(
        BrokerConfig,
        {"port": "8080", "retention_hours": "1.5", "data_dir": "var/broker", "flush": "periodic", "host": "::1"},
    )

    assert cfg.port == 8080
    assert cfg.retention_hours == 1.5
    assert cfg.data_dir == Path("var/broker")
    assert cfg.flush == "periodic"
    assert cfg.host == "::1"


def test_whole_numbers_are_accepted_for_floats() -> None:
    assert build_config(BrokerConfig, {"retention_hours": 2}).retention_hours == 2.0


def test_path_objects_are_accepted() -> None:
    assert build_config(MetaConfig, {"data_dir": Path("/tmp/meta")}).data_dir == Path("/tmp/meta")


def test_unknown_key_is_named_with_the_known_keys() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(MetaConfig, {"prot": 1, "host": "h"}, source="qmq.toml [meta]")

    text = str(info.value)
    assert text.startswith("qmq.toml [meta]: unknown key(s) prot for MetaConfig")
    assert "known keys: data_dir, host, port, db_url, heartbeat_timeout_ms, route_groups" in text


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ({"port": "eighty"}, r"port = 'eighty' must be a whole number"),
        ({"port": 1.5}, r"port = 1.5 must be a whole number"),
        ({"port": True}, r"port = True must be a whole number"),
        ({"port": None}, r"port = None must be a whole number"),
        ({"retention_hours": "soon"}, r"retention_hours = 'soon' must be a number"),
        ({"retention_hours": False}, r"retention_hours = False must be a number"),
        ({"host": 127}, r"host = 127 must be a string"),
        ({"data_dir": ""}, r"data_dir = '' must be a non-empty path"),
        ({"data_dir": 5}, r"data_dir = 5 must be a non-empty path"),
    ],
)
def test_wrong_types_name_the_key_and_value(values: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^cli: {text}"):
        build_config(BrokerConfig, values, source="cli")


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ({"port": 65536}, r"port = 65536 must be a TCP port, 0 to 65535"),
        ({"port": -1}, r"port = -1 must be a TCP port"),
        ({"flush_interval_ms": 0}, r"flush_interval_ms = 0 must be between 1 and 60000"),
        ({"flush_interval_ms": "60001"}, r"flush_interval_ms = '60001' must be between 1 and 60000"),
        ({"retention_hours": "nan"}, r"retention_hours = 'nan' must be between"),
        ({"retention_hours": 0}, r"retention_hours = 0 must be between 0.001 and 87600"),
    ],
)
def test_out_of_range_values_name_the_key_and_value(values: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^configuration: {text}"):
        build_config(BrokerConfig, values)


def test_range_ends_are_allowed() -> None:
    cfg = build_config(BrokerConfig, {"port": 65535, "http_port": 0, "flush_interval_ms": 60_000})

    assert (cfg.port, cfg.http_port, cfg.flush_interval_ms) == (65535, 0, 60_000)


def test_literal_choices_are_listed() -> None:
    with pytest.raises(ConfigError, match=r"flush = 'async' is not allowed; use one of 'sync', 'periodic'"):
        build_config(BrokerConfig, {"flush": "async"})
    assert build_config(Toy, {"mode": "b"}).mode == "b"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        ("true", True),
        ("FALSE", False),
        ("Yes", True),
        ("no", False),
        ("1", True),
        ("0", False),
    ],
)
def test_bools_and_bool_strings(value: object, expected: bool) -> None:
    assert build_config(Toy, {"verbose": value}).verbose is expected


@pytest.mark.parametrize("value", ["maybe", "", 1, 0, None])
def test_other_values_for_a_bool_are_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=rf"verbose = {value!r} must be true or false"):
        build_config(Toy, {"verbose": value})


def test_a_field_type_the_loader_does_not_know_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"Unsupported.names has a type the loader does not know"):
        build_config(Unsupported, {"names": ["a"]})


# ---- TOML files ----


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "qmq.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_no_file_gives_no_values() -> None:
    assert load_toml_section(None, "broker") == {}


def test_section_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\nport = 9000\nflush = "periodic"\n[meta]\nport = 9001\n')

    assert load_toml_section(path, "broker") == {"port": 9000, "flush": "periodic"}
    assert load_toml_section(path, "standalone") == {}


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"

    with pytest.raises(ConfigError, match=rf"config file '{re.escape(str(path))}' does not exist"):
        load_toml_section(path, "broker")


def test_bad_toml_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[broker\nport = 1\n")

    with pytest.raises(ConfigError, match=rf"config file '{re.escape(str(path))}' is not valid TOML"):
        load_toml_section(path, "broker")


def test_file_that_is_not_utf8_is_bad_toml(tmp_path: Path) -> None:
    path = write(tmp_path, b'[broker]\nhost = "\xff"\n')

    with pytest.raises(ConfigError, match=r"is not valid TOML"):
        load_toml_section(path, "broker")


def test_unreadable_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"config file '{re.escape(str(tmp_path))}' cannot be read"):
        load_toml_section(tmp_path, "broker")


def test_section_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "broker = 5\n")

    with pytest.raises(ConfigError, match=r"\[broker\] must be a table"):
        load_toml_section(path, "broker")


def test_overrides_win_over_the_file_and_none_means_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\nport = 9000\nhost = "0.0.0.0"\ngroup = "g1"\n')

    values = merged(path, "broker", {"port": 9100, "host": None, "flush": "periodic"})

    assert values == {"port": 9100, "host": "0.0.0.0", "group": "g1", "flush": "periodic"}
    assert build_config(BrokerConfig, values).port == 9100


def test_merged_without_a_file_is_the_given_overrides() -> None:
    assert merged(None, "meta", {"port": 1, "host": None}) == {"port": 1}
