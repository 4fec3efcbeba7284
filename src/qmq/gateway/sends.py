"""``POST /v1/subjects/{subject}/messages``: one message or a batch, answered once stored.

The answer comes when ``Producer.send`` returns, so under the broker's flush policy exactly
as for a Python producer; a ``message_id`` sent again is dropped by the broker's duplicate
window, so a client may repeat a send whose answer it never got.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from qmq.aio import Message, Producer
from qmq.common.errors import BufferFullError, InvalidMessageError, QmqError
from qmq.gateway.errors import ApiError, api_error_of
from qmq.gateway.payload import parse_send

# W3C trace context: a traceparent is 55 characters; tracestate values past this are not kept
_TRACE_HEADER_CHARS_MAX = 512


def _sent(producer: Producer, messages: list[Message]) -> list[asyncio.Future[None]]:
    """A future per message, resolved once it is stored: buffered at once while the producer has
    room (no task per message: a batch of 100 is one request's work), the rest, once it is full,
    sent one after another as ``await producer.send`` does (it waits for room)."""
    futures: list[asyncio.Future[None]] = []
    for i, m in enumerate(messages):
        try:
            futures.append(producer.send_nowait(m))
        except BufferFullError:
            rest = messages[i:]
            outcomes = asyncio.get_running_loop().create_task(_send_in_turn(producer, rest))
            futures += [_nth(outcomes, k) for k in range(len(rest))]
            break
        except QmqError as exc:  # refused before it was buffered: this one fails, the others go on
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            futures.append(failed)
    return futures


async def _send_in_turn(producer: Producer, messages: list[Message]) -> list[BaseException | None]:
    out: list[BaseException | None] = []
    for m in messages:
        try:
            await producer.send(m)
            out.append(None)
        except QmqError as exc:
            out.append(exc)
    return out


def _nth(task: asyncio.Task[list[BaseException | None]], k: int) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = task.get_loop().create_future()

    def done(t: asyncio.Task[list[BaseException | None]]) -> None:
        if t.cancelled():
            fut.cancel()
        elif (exc := t.exception()) is not None:
            fut.set_exception(exc)
        elif (outcome := t.result()[k]) is not None:
            fut.set_exception(outcome)
        else:
            fut.set_result(None)

    task.add_done_callback(done)
    return fut


async def send(
    producer: Producer, subject: str, raw: bytes, context: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The answer document of a send (raises ApiError for the whole request). ``context``: the
    request's ``traceparent``/``tracestate`` headers, kept as the properties of each message
    that has none of its own, so the send's span (or the consumer's) continues the caller's trace."""
    request = parse_send(subject, raw)
    if context and all(len(v) <= _TRACE_HEADER_CHARS_MAX for v in context.values()):
        for m in request.messages:
            if m.get_property("traceparent") is None:
                # a message already at its most properties is sent without the caller's context
                with contextlib.suppress(InvalidMessageError):
                    for key, value in context.items():
                        m.set_property(key, value)
    results = await asyncio.gather(*_sent(producer, request.messages), return_exceptions=True)
    if not request.batch:
        [result] = results
        if isinstance(result, QmqError):
            raise api_error_of(result)
        if isinstance(result, BaseException):
            raise result
        return {"message_id": request.messages[0].message_id}
    out: list[dict[str, Any]] = []
    for m, result in zip(request.messages, results, strict=True):
        if isinstance(result, QmqError):
            err = api_error_of(result)
            out.append({"message_id": m.message_id, "error": {"code": err.code, "message": err.message}})
        elif isinstance(result, BaseException):
            raise result
        else:
            out.append({"message_id": m.message_id})
    if all("error" in r for r in out):
        # nothing stored: answer as for one message, with the first reason
        first = results[0]
        assert isinstance(first, QmqError)
        err = api_error_of(first)
        raise ApiError(err.status, err.code, f"no message of the batch was stored: {err.message}")
    return {"results": out}
