"""Every knob is checked when the object is made: a bad value raises ConfigError naming it."""

from __future__ import annotations

import re
import socket

import pytest

import qmq
from qmq import ConfigError, MetaServerError
from qmq.aio import Consumer, Producer
from qmq.client.failure import failure_subjects
from qmq.client.meta import MetaClient, parse_answer
from qmq.client.options import default_consumer_id
from qmq.client.pull_consumer import check_pull_args

URL = "http://127.0.0.1:1/meta/address"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("buffer_messages_max", 0),
        ("buffer_bytes_max", 10),
        ("batch_messages_max", 10_001),
        ("batch_bytes_max", 1 << 30),
        ("max_in_flight", 0),
        ("linger_ms", -1),
        ("send_timeout_ms", 0),
        ("retry_backoff_ms", "50"),
        ("connect_timeout_ms", True),
        ("close_timeout_ms", 1.5),
    ],
)
def test_a_bad_producer_option_is_named(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{option}={value!r}")):
        Producer(app_code="shop", meta_server=URL, **{option: value})  # type: ignore[arg-type]


def test_backoff_max_may_not_be_below_backoff() -> None:
    with pytest.raises(ConfigError, match="retry_backoff_ms_max=10"):
        Producer(app_code="shop", meta_server=URL, retry_backoff_ms=100, retry_backoff_ms_max=10)


@pytest.mark.parametrize(
    ("option", "value"),
    [("ack_flush_ms", 0), ("max_retries", -1), ("request_timeout_ms", 0), ("check_crc", "yes")],
)
def test_a_bad_consumer_option_is_named(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{option}={value!r}")):
        Consumer(app_code="billing", meta_server=URL, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"app_code": "", "meta_server": URL}, "app_code"),
        ({"app_code": "has space", "meta_server": URL}, "app_code"),
        ({"app_code": "shop", "meta_server": "127.0.0.1:8080"}, "meta_server"),
        ({"app_code": "shop", "meta_server": URL, "consumer_id": "a/b"}, "consumer_id"),
        ({"app_code": "shop", "meta_server": URL, "consumer_id": 7}, "consumer_id"),
    ],
)
def test_identity_options_are_checked(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Consumer(**kwargs)  # type: ignore[arg-type]


def test_the_blocking_sdk_names_unknown_options() -> None:
    # typed keywords, as the asyncio SDK's: mypy names a wrong one, and so does Python
    for cls in (qmq.Producer, Producer):
        with pytest.raises(TypeError, match="buffer_size"):
            cls(app_code="shop", meta_server=URL, buffer_size=10)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="listener_threads=0"):
        qmq.Consumer(app_code="shop", meta_server=URL, listener_threads=0)


def test_pull_arguments_are_checked() -> None:
    assert check_pull_args(1, 0) == (1, 0)
    with pytest.raises(ConfigError, match="max_messages=0"):
        check_pull_args(0, 10)
    with pytest.raises(ConfigError, match="timeout_ms=60001"):
        check_pull_args(10, 60_001)


def test_listener_handlers_must_be_async_and_start_from_known() -> None:
    consumer = Consumer(app_code="billing", meta_server=URL)

    def plain(_m: object) -> None: ...

    with pytest.raises(ConfigError, match="async def"):
        consumer.listener("s", "g")(plain)  # type: ignore[type-var]
    with pytest.raises(ConfigError, match="start_from='middle'"):
        consumer.pull_consumer("s", "g", start_from="middle")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="concurrency=0"):

        @consumer.listener("s", "g", concurrency=0)
        async def handler(_m: object) -> None: ...


def test_default_consumer_ids_are_unique_and_valid_names() -> None:
    a, b = default_consumer_id(), default_consumer_id()
    assert a != b
    assert str(__import__("os").getpid()) in a
    Consumer(app_code="x", meta_server=URL, consumer_id=a)


def test_meta_answers_are_read_and_checked() -> None:
    answer = parse_answer(
        URL,
        {
            "broker_groups": [
                {"group": "b1", "address": "127.0.0.1:1", "state": "available", "role": "master"},
                {"group": "b2", "address": "127.0.0.1:2", "state": "unavailable", "role": "master"},
            ],
            "routes": {"s": ["b1", "b2"], "t": []},
            "refresh_ms": 5,
        },
    )
    assert list(answer.groups) == ["b1"]
    assert answer.routes == {"s": ("b1", "b2")}
    assert answer.refresh_ms == 100  # bounded below
    for bad in [[], {"broker_groups": {}}, {"broker_groups": [{"group": 1}]}, {"broker_groups": [], "routes": []}]:
        with pytest.raises(MetaServerError, match=re.escape(URL)):
            parse_answer(URL, bad)


async def test_an_unreachable_meta_server_at_start_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound and not listening: connections are refused
        url = f"http://127.0.0.1:{port}/meta/address"
        meta = MetaClient(url, timeout_ms=2000)
        with pytest.raises(MetaServerError, match=re.escape(url)):
            await meta.start()
        with pytest.raises(MetaServerError, match=re.escape(url)):
            async with Producer(app_code="shop", meta_server=url):
                pass


def test_failed_messages_go_to_the_retry_then_dead_letter_subject_of_their_group() -> None:
    assert failure_subjects("order.paid", "billing") == ("%RETRY%order.paid%billing", "%DEAD_RETRY%order.paid%billing")
    # read from the retry subject directly: still the same pair
    assert failure_subjects("%RETRY%order.paid%billing", "ops") == (
        "%RETRY%order.paid%billing",
        "%DEAD_RETRY%order.paid%billing",
    )
    # a dead letter failed again stays where it is
    assert failure_subjects("%DEAD_RETRY%order.paid%billing", "ops") == ("%DEAD_RETRY%order.paid%billing",) * 2
