"""The console of a meta server without an auth file (loopback only): open, no credentials."""

from __future__ import annotations

import urllib.request

import pytest

pytestmark = pytest.mark.integration


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/html")
        return str(answer.read().decode())


def test_the_console_is_served_without_an_auth_file(meta_server: str) -> None:
    base = meta_server.removesuffix("/meta/address")
    assert "<h2>Groups</h2>" in _get(base + "/console")  # redirected to /console/
    assert 'id="subjects"' in _get(base + "/console/subjects")
    with urllib.request.urlopen(base + "/console/static/vendor/htmx-2.0.11.min.js", timeout=10) as answer:
        assert answer.status == 200
        assert len(answer.read()) > 10_000
