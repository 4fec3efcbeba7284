"""Request codes and response status codes: two enums, never one shared namespace."""

from __future__ import annotations

from enum import IntEnum


class RequestCode(IntEnum):
    PING = 1
    SEND_MESSAGES = 2
    PULL = 3
    ACK = 4
    SUBJECTS = 5
    LAG = 6
    # answered by delay servers only: pending messages per time bucket (docs/protocol.md)
    DELAY_STATS = 7
    # consumer-group administration (docs/protocol.md)
    RESET_OFFSET = 8
    DEAD_LETTERS = 9
    RESEND_DEAD = 10
    PURGE_DEAD = 11
    # reading a subject by sequence, outside any consumer group (data jobs, docs/protocol.md)
    READ = 12
    # slave → master: copy the message log and the action log (docs/cluster.md)
    REPLICATE = 13
    # the acks of many (subject, group) pairs of one consumer in one request (docs/protocol.md)
    ACK_MANY = 14
    # acks, give-backs and held positions of one consumer's pull log: receipts of the HTTP
    # gateways, settled by any of them (docs/protocol.md, broker/settle.py)
    SETTLE = 15
    # answered by delay servers only (docs/protocol.md); numbered apart from the broker's commands
    # so that codes other branches add next to them never collide
    CANCEL_DELAY = 24
    DELAY_LIST = 25
    # what a broker's files tell of one message id (qmq trace --meta-server; docs/protocol.md);
    # numbered apart from the others so that codes other branches add never collide
    TRACE = 30
    # a connection authenticates once, before any other request, on a server with an auth file
    # (qmq.auth.handshake; docs/security.md): HELLO is answered with a challenge, PROOF with OK
    AUTH_HELLO = 40
    AUTH_PROOF = 41
    # one consumer's pulls of many (subject, group) pairs in one request (broker/pull_many.py;
    # docs/protocol.md); numbered apart so that codes other branches add never collide
    PULL_MANY = 50


class Status(IntEnum):
    OK = 0
    # The request was understood and refused; repeating it unchanged will fail again.
    BAD_REQUEST = 1
    INVALID_MESSAGE = 2
    MESSAGE_TOO_LARGE = 3
    INVALID_SUBJECT = 4
    UNKNOWN_COMMAND = 5
    # auth: the connection has not authenticated, or failed to; the app may not do this
    UNAUTHENTICATED = 30
    FORBIDDEN = 31
    # The broker cannot take it now; the same request may succeed later or elsewhere.
    BUSY = 20
    DISK_FULL = 21
    NOT_MASTER = 22
    SHUTTING_DOWN = 23
    INTERNAL_ERROR = 24
    # over the app's quota (docs/security.md): send again after the answer's retry_after_ms
    THROTTLED = 25


RETRIABLE_STATUSES = frozenset(
    {Status.BUSY, Status.DISK_FULL, Status.NOT_MASTER, Status.SHUTTING_DOWN, Status.THROTTLED}
)
