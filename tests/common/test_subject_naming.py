"""Subjects and consumer groups: valid names, retry/dead-letter names, and their file names."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.common.naming import (
    check_name,
    check_subject,
    dead_subject,
    parse_internal_subject,
    retry_subject,
    subject_file_name,
    subject_of_file_name,
)


@pytest.mark.parametrize("name", ["a", "orders.created", "订单", "A-b_c:d@e#1", "x" * 100, "."])
def test_valid_names_are_returned(name: str) -> None:
    assert check_name("subject", name) == name
    assert check_subject(name) == name


def test_empty_name_is_refused() -> None:
    with pytest.raises(InvalidSubjectError, match=r"^consumer group must not be empty$"):
        check_name("consumer group", "")


def test_101_characters_is_one_too_many() -> None:
    with pytest.raises(InvalidSubjectError, match=r"has 101 characters; the limit is 100"):
        check_subject("x" * 101)


@pytest.mark.parametrize("value", [None, 5, b"orders"])
def test_non_string_is_refused_with_its_type(value: object) -> None:
    with pytest.raises(InvalidSubjectError, match=rf"subject must be a string, got {type(value).__name__}"):
        check_subject(value)


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("a b", r"' '"),
        ("tab\there", r"'\\t'"),
        ("line\n", r"'\\n'"),
        ("wide\u3000space", r"'\\u3000'"),
        ("a/b", r"'/'"),
        ("nul\x00", r"'\\x00'"),
        ("unit\x1f", r"'\\x1f'"),
        ("del\x7f", r"'\\x7f'"),
        ("csi\x9b", r"'\\x9b'"),
        ("nel\x85", r"'\\x85'"),
    ],
)
def test_whitespace_slash_and_control_characters_are_refused(name: str, shown: str) -> None:
    with pytest.raises(InvalidSubjectError, match=rf"contains {shown} at position \d+; use letters"):
        check_name("subject", name)


def test_percent_is_reserved_for_internal_subjects() -> None:
    with pytest.raises(InvalidSubjectError, match=r"contains % at position 5.*reserved for retry and dead"):
        check_name("consumer group", "group%1")


def test_error_names_the_kind_and_the_value() -> None:
    with pytest.raises(InvalidSubjectError, match=r"^consumer group 'my group' contains ' ' at position 2"):
        check_name("consumer group", "my group")


# ---- retry and dead-letter subjects ----


def test_retry_and_dead_subjects_are_accepted_and_parsed() -> None:
    retry = retry_subject("orders.created", "billing")
    dead = dead_subject("orders.created", "billing")

    assert retry == "%RETRY%orders.created%billing"
    assert dead == "%DEAD_RETRY%orders.created%billing"
    assert check_subject(retry) == retry
    assert check_subject(dead) == dead
    assert parse_internal_subject(retry) == ("retry", "orders.created", "billing")
    assert parse_internal_subject(dead) == ("dead", "orders.created", "billing")


def test_longest_internal_subject_fits() -> None:
    name = dead_subject("s" * 100, "g" * 100)

    assert len(name) <= DEFAULT_LIMITS.internal_subject_chars_max
    assert parse_internal_subject(name) == ("dead", "s" * 100, "g" * 100)


@pytest.mark.parametrize(
    "name",
    [
        "%RETRY%",
        "%RETRY%orders",
        "%RETRY%%billing",
        "%RETRY%orders%",
        "%RETRY%orders%billing%extra",
        "%RETRY%my orders%billing",
        "%RETRY%orders%bill/ing",
        "%DEAD_RETRY%orders",
        "%DEAD_RETRY%%",
        "%RETRY%" + "s" * 101 + "%g",
        "%RETRY%%RETRY%orders%billing%billing",
    ],
)
def test_malformed_internal_subjects_are_refused(name: str) -> None:
    with pytest.raises(InvalidSubjectError):
        check_subject(name)
    with pytest.raises(InvalidSubjectError):
        parse_internal_subject(name)


@pytest.mark.parametrize("name", ["%OTHER%orders%billing", "orders", "%retry%orders%billing"])
def test_only_the_two_prefixes_are_internal(name: str) -> None:
    with pytest.raises(InvalidSubjectError, match=r"is not a valid %RETRY%<subject>%<group>"):
        parse_internal_subject(name)


def test_internal_subject_over_its_limit_names_the_length() -> None:
    name = "%RETRY%" + "s" * 300 + "%g"

    with pytest.raises(InvalidSubjectError, match=r"has 309 characters; the limit is 255"):
        check_subject(name)


# ---- file names ----


def assert_file_system_safe(file_name: str) -> None:
    assert file_name not in ("", ".", "..")
    assert "/" not in file_name
    assert "\x00" not in file_name
    assert not file_name.startswith(".")
    assert len(file_name.encode("utf-8")) <= 255
    assert file_name.isascii()
    assert file_name.isprintable()


@pytest.mark.parametrize("subject", ["orders.created", "Orders-2024_v1", "a", "x" * 100, "a.b.c"])
def test_plain_names_stay_readable(subject: str) -> None:
    assert subject_file_name(subject) == subject


@pytest.mark.parametrize(
    ("subject", "expected"),
    [
        (".", "~2E"),
        ("..", "~2E."),
        (".hidden", "~2Ehidden"),
        ("a/b", "a~2Fb"),
        ("~", "~7E"),
        ("%RETRY%s%g", "~25RETRY~25s~25g"),
        ("é", "~C3~A9"),
    ],
)
def test_other_characters_are_escaped(subject: str, expected: str) -> None:
    assert subject_file_name(subject) == expected
    assert_file_system_safe(expected)


def test_long_names_are_cut_and_hashed_and_stay_distinct() -> None:
    a = "界" * 99 + "a"
    b = "界" * 99 + "b"

    fa, fb = subject_file_name(a), subject_file_name(b)

    assert fa != fb
    assert_file_system_safe(fa)
    assert_file_system_safe(fb)
    assert len(subject_file_name(dead_subject("界" * 100, "組" * 100))) <= 255


def _is_valid_subject(s: str) -> bool:
    try:
        check_subject(s)
    except InvalidSubjectError:
        return False
    return True


# Leaving out what check_name forbids keeps Hypothesis from discarding most of what it draws.
name_chars = st.characters(exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), exclude_characters="/%")
user_names = st.text(name_chars, min_size=1, max_size=100).filter(_is_valid_subject)
subjects = st.one_of(
    user_names,
    st.text(alphabet="abc.~-_界", min_size=1, max_size=60),
    st.builds(retry_subject, user_names, user_names),
    st.builds(dead_subject, user_names, user_names),
).filter(_is_valid_subject)


@settings(max_examples=200, deadline=None)
@given(st.lists(subjects, min_size=2, max_size=10, unique=True))
def test_file_names_are_safe_and_distinct(names: list[str]) -> None:
    files = [subject_file_name(n) for n in names]

    for f in files:
        assert_file_system_safe(f)
    assert len(set(files)) == len(names)


@given(st.text(min_size=1, max_size=120))
@settings(max_examples=300)
def test_a_file_name_gives_back_its_subject_unless_it_was_cut_and_hashed(subject: str) -> None:
    name = subject_file_name(subject)
    assert subject_of_file_name(name) == (None if "~~" in name else subject)


@pytest.mark.parametrize("name", ["", ".hidden", "~zz", "~41", "a~2", "~FF", "x" * 151, "a~~0123456789abcdef"])
def test_a_name_no_subject_is_escaped_to_gives_none(name: str) -> None:
    assert subject_of_file_name(name) is None
