"""Permission checks: produce and consume patterns, subject:group, admin, retry subjects."""

from __future__ import annotations

from pathlib import Path

import pytest

from qmq.auth.file import load_auth_file
from qmq.auth.permissions import Action, Grants, parse_consume_patterns, parse_patterns
from qmq.auth.secrets import hash_secret
from qmq.common.errors import ConfigError


def grants(produce: list[str] = [], consume: list[str] = [], admin: bool = False) -> Grants:  # noqa: B006 - read only
    return Grants(parse_patterns(produce, "p"), parse_consume_patterns(consume, "c"), admin=admin)


def test_produce_patterns() -> None:
    g = grants(produce=["order.*", "pay"])
    assert g.allows(Action.PRODUCE, "order.created")
    assert g.allows(Action.PRODUCE, "pay")
    assert not g.allows(Action.PRODUCE, "payment")  # a pattern matches the whole name
    assert not g.allows(Action.PRODUCE, "xorder.created")
    assert not g.allows(Action.CONSUME, "order.created")  # produce does not give consume
    assert not g.allows(Action.ADMIN)


def test_consume_patterns_with_and_without_a_group() -> None:
    g = grants(consume=["order.*:billing", "audit"])
    assert g.allows(Action.CONSUME, "order.created", "billing")
    assert not g.allows(Action.CONSUME, "order.created", "shipping")
    assert not g.allows(Action.CONSUME, "order.created", None)
    assert g.allows(Action.CONSUME, "audit", "anyone")
    assert not g.allows(Action.PRODUCE, "audit")


def test_retry_and_dead_subjects_belong_to_their_group() -> None:
    g = grants(produce=["*"], consume=["order.*:billing"])
    assert g.allows(Action.PRODUCE, "%RETRY%order.created%billing")
    assert g.allows(Action.CONSUME, "%DEAD_RETRY%order.created%billing", "billing")
    assert not g.allows(Action.PRODUCE, "%RETRY%order.created%shipping")
    assert not g.allows(Action.PRODUCE, "%RETRY%broken")


def test_admin_and_cluster() -> None:
    assert grants(admin=True).allows(Action.ADMIN)
    assert not grants(admin=True).allows(Action.CLUSTER)
    assert not grants(admin=True).allows(Action.PRODUCE, "x")
    cluster = Grants(cluster=True)
    assert cluster.allows(Action.CLUSTER)
    assert cluster.allows(Action.PRODUCE, "x")
    assert cluster.allows(Action.ADMIN)


def test_the_auth_file(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(
        f"""
[apps.shop]
secret_hash = "{hash_secret("a", log2_n=4)}"
produce = ["order.*"]
consume = ["order.*:billing"]
[apps.ops]
secret_hash = "{hash_secret("b", log2_n=4)}"
admin = true
"""
    )
    auth = load_auth_file(path)
    assert sorted(auth.apps) == ["ops", "shop"]
    assert auth.apps["shop"].grants.allows(Action.PRODUCE, "order.x")
    assert auth.apps["ops"].grants.admin
    assert auth.app("nobody") is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[apps.shop]\nproduce = []\n", "no secret_hash"),
        ('[apps.shop]\nsecret_hash = "H"\nproduse = []\n', "unknown key.*produse"),
        ('[apps.shop]\nsecret_hash = "H"\nproduce = "order.*"\n', "must be a list"),
        ('[apps.shop]\nsecret_hash = "H"\nconsume = [":billing"]\n', "empty subject or group"),
        ('[apps.shop]\nsecret_hash = "H"\nadmin = "yes"\n', "true or false"),
        ("[users.shop]\n", "unknown table"),
        ("[apps.shop\n", "not valid TOML"),
    ],
)
def test_a_bad_auth_file_is_named(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(text.replace("H", hash_secret("a", log2_n=4)))
    with pytest.raises(ConfigError, match=says) as info:
        load_auth_file(path)
    assert str(path) in str(info.value)


def test_a_missing_auth_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_auth_file(tmp_path / "none.toml")
