"""Commands for people: send, consume, subjects, lag (they use the SDK)."""

from __future__ import annotations
