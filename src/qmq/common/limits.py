"""Every limit qmq enforces: its name, its default and why it is that size.

Limits are checked where input enters (the SDK before a message is batched, the broker
when a frame arrives) and each breach raises an error naming the limit and the value.
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB

# A message due at most this far ahead goes to a broker, which writes it at once and makes it
# visible once due (qmq.store.held); a delay server hands its due messages over this far
# ahead at most (its handover_lead_ms), so a slow hand-over or fsync does not make them late.
HOLD_UNTIL_DUE_MS = 100
# A broker holds a message due at most this far ahead (the rest of the bound above
# HOLD_UNTIL_DUE_MS absorbs clock differences between hosts); later ones it refuses.
HOLD_MS_MAX = 1000
# Subjects one meta server request (GET /meta/address) may ask routes for: the server refuses
# more, and a client asks for more in several requests.
META_SUBJECTS_PER_REQUEST_MAX = 256
# A repeating delay message (Message.set_repeat): copies at least a second apart (the delay
# server's timer is finer, but a tighter loop is a realtime stream, not a schedule), at most
# this many copies, and the last within the delay server's horizon. A delay server stores each
# copy as a message of its own, written with one write as the send arrives: so the copies of
# one send also stay within REPEAT_BYTES_MAX in all (10,000 copies of a 6 KiB message).
REPEAT_EVERY_MS_MIN = 1_000
REPEAT_COPIES_MAX = 10_000
REPEAT_BYTES_MAX = 64 * MiB


@dataclass(frozen=True, slots=True)
class Limits:
    # A message is stored and delivered whole; a 4 MiB body keeps one message well inside a
    # frame and a segment, and matches what QMQ's users send (business events, not files).
    body_bytes_max: int = 4 * MiB
    # The encoded message: the body plus its header, subject, id, tags and properties. The
    # 64 KiB above body_bytes_max let a body of exactly 4 MiB through with ordinary properties.
    message_bytes_max: int = 4 * MiB + 64 * KiB
    # A frame carries a batch of messages or a pull's records; it is buffered whole on both
    # sides, so this bounds the memory one connection can make a peer hold.
    frame_bytes_max: int = 16 * MiB
    # The frame header is a small msgpack map of request parameters, never data.
    frame_header_bytes_max: int = 64 * KiB
    # Messages in one send frame: bounds the per-frame loop on the broker.
    batch_messages_max: int = 10_000
    # User subjects and consumer group names: short names, safe to show and to log.
    subject_chars_max: int = 100
    # Retry and dead-letter subjects embed a subject and a group: %DEAD_RETRY%<100>%<100>.
    internal_subject_chars_max: int = 255
    # Message ids carry their creation time and origin; 128 leaves room for custom ids.
    message_id_chars_max: int = 128
    # QMQ allows ten tags a message; each is matched on the broker.
    tags_max: int = 10
    tag_chars_max: int = 64
    # Properties are for routing and business keys; the body is for data.
    properties_max: int = 128
    property_key_chars_max: int = 256
    # A message's delivery attempt: a group retries at most 10,000 times (max_retries), so an
    # attempt count above this is a client's bug, refused before it can wrap around.
    attempts_max: int = 10_001
    # Pulls: how much one pull may return.
    pull_messages_max: int = 10_000
    pull_bytes_max: int = 8 * MiB
    # A long poll never parks a request longer than this.
    pull_timeout_ms_max: int = 60_000


DEFAULT_LIMITS = Limits()
