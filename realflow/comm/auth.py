"""HMAC-SHA256 signing of multi-frame messages with a per-experiment secret.

Why: every process of an experiment shares one secret; anything on the control
plane that is not signed with it (a stray client, a port scanner, a process of
another experiment that reused a port) is dropped before it is decoded.

Signed message layout (what goes on the wire after ZMQ's own routing frames)::

    [mac(32 bytes) + len(auth_header)(u16 LE) + auth_header + payload_frame_1, payload_frame_2, ...]

    auth_header = msgpack [version, sender, to, session, seq, ts, [len(payload_frame_i)...]]
    mac         = HMAC-SHA256(secret, len(auth_header) || auth_header || payload_frame_1 || ... || payload_frame_n)

(the MAC covers everything after itself, so the first frame is hashed in place, without joining.)

The header carries the payload frame lengths, so moving bytes between frames or
dropping/adding a frame breaks the MAC. MAC, header and the first payload frame
(the small codec header) share one ZMQ frame because every extra frame costs
~10 us per round trip; later payload frames (tensor buffers) stay separate and
are never copied.

What the verifier guarantees
----------------------------
* Integrity and authenticity: every byte of every frame is covered by the MAC;
  comparison uses ``hmac.compare_digest``.
* Addressing: a message signed for receiver A is rejected by receiver B.
* Replay within a receiver's lifetime: each signer has a random 8-byte session id
  and a strictly increasing sequence number. The receiver remembers, per
  (sender, session), the highest sequence accepted (up to ``max_sessions``
  sessions, least recently used evicted) and rejects anything not above it, so an
  exact replay or a duplicate is always rejected while its session is remembered.
* Replay across receiver restarts: the first message of a session unknown to the
  receiver must carry a timestamp within ``max_age`` seconds of the receiver's
  clock. A message captured more than ``max_age`` ago is rejected; a message
  captured less than ``max_age`` ago *can* be replayed once to a freshly started
  receiver (documented limitation; hosts' clocks are assumed NTP-synced).
* Ordering: ZMQ keeps order per connection, so a strictly increasing sequence is
  what honest peers produce; a signer must be used by one socket only.
Nothing is encrypted: the secret authenticates, it does not hide the payload.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import time
from collections import OrderedDict
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import msgpack

__all__ = [
    "SECRET_ENV", "AuthError", "Envelope", "Signer", "Verifier",
    "new_secret", "secret_to_hex", "secret_from_env", "check_secret",
]

SECRET_ENV = "REALFLOW_SECRET"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
_VERSION = 1
_MAX_HEADER_BYTES = 4096


class AuthError(Exception):
    """A message failed verification. ``claimed_sender`` is what the (unverified) header says."""

    def __init__(self, reason: str, claimed_sender: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.claimed_sender = claimed_sender


def new_secret(nbytes: int = 32) -> bytes:
    """A fresh random experiment secret (give it to workers as hex via REALFLOW_SECRET)."""
    if nbytes < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, asked for {nbytes}")
    return os.urandom(nbytes)


def secret_to_hex(secret: bytes) -> str:
    return check_secret(secret).hex()


def check_secret(secret: Any) -> bytes:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required")
    return bytes(secret)


def secret_from_env(var: str = SECRET_ENV, environ: Mapping[str, str] | None = None) -> bytes:
    """Read the hex-encoded experiment secret from the environment (``REALFLOW_SECRET``)."""
    env = os.environ if environ is None else environ
    value = env.get(var)
    if not value:
        raise KeyError(f"environment variable {var} is not set; the launcher must export the experiment "
                       f"secret as hex (realflow.comm.auth.secret_to_hex(new_secret()))")
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        raise ValueError(f"environment variable {var} is not valid hex ({len(value)} characters)") from None
    try:
        return check_secret(secret)
    except ValueError as e:
        raise ValueError(f"environment variable {var}: {e}") from None


class Envelope(NamedTuple):
    """The verified auth header of a message (a named tuple: built per message, so it must be cheap)."""

    sender: str
    to: str
    session: bytes
    seq: int
    ts: float


_HLEN = struct.Struct("<H")


def _mac(base: Any, signed_first: Any, rest: Sequence[Any]) -> bytes:
    """HMAC-SHA256 over the first frame after its MAC (length, header, payload) and every later frame.

    ``base`` is an HMAC object already keyed with the secret: copying it skips the key
    schedule, which is most of the cost for the small control messages.
    """
    h = base.copy()
    h.update(signed_first)
    for f in rest:
        h.update(f)
    return h.digest()


class Signer:
    """Signs outgoing messages of one sender (one socket: sequence numbers must stay ordered)."""

    def __init__(self, secret: bytes, sender: str) -> None:
        self._key = check_secret(secret)
        self._base = hmac.new(self._key, digestmod=hashlib.sha256)
        self.sender = sender
        self.session = os.urandom(8)
        self._seq = itertools.count(1)

    def sign(self, frames: Sequence[Any], to: str) -> list[Any]:
        """Return the signed frames (the first payload frame is copied behind the MAC, the others are not)."""
        if not frames:
            raise ValueError("nothing to sign: at least one payload frame is required")
        lens = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        header = msgpack.packb([_VERSION, self.sender, to, self.session, next(self._seq), time.time(), lens],
                               use_bin_type=True)
        body = b"".join((_HLEN.pack(len(header)), header, frames[0]))
        rest = frames[1:]
        return [_mac(self._base, body, rest) + body, *rest]


class Verifier:
    """Verifies incoming messages for one receiver; keeps replay state (not thread-safe)."""

    def __init__(self, secret: bytes, receivers: str | Iterable[str], max_age: float = 120.0,
                 max_sessions: int = 4096) -> None:
        self._key = check_secret(secret)
        self._base = hmac.new(self._key, digestmod=hashlib.sha256)
        self.receivers = frozenset([receivers] if isinstance(receivers, str) else receivers)
        self.max_age = float(max_age)
        self.max_sessions = int(max_sessions)
        self._last_seq: OrderedDict[tuple[str, bytes], int] = OrderedDict()

    def verify(self, frames: Sequence[Any]) -> tuple[Envelope, list[Any]]:
        """Check a signed message; return the envelope and the payload frames or raise AuthError."""
        if not frames:
            raise AuthError("empty message")
        first = frames[0]
        if type(first) is not bytes:  # a zero-copy frame: look at its buffer
            first = memoryview(first)
            if first.ndim != 1 or first.format != "B":
                first = first.cast("B")
        n = len(first)
        if n < MAC_BYTES + 2:
            raise AuthError(f"unsigned message (first frame is {n} bytes, too short for a MAC + header)")
        hlen = first[MAC_BYTES] | first[MAC_BYTES + 1] << 8
        start = MAC_BYTES + 2 + hlen
        if hlen > _MAX_HEADER_BYTES or start > n:
            raise AuthError(f"garbled auth header (claims {hlen} bytes)")
        try:
            fields = msgpack.unpackb(first[MAC_BYTES + 2:start], raw=False)
        except Exception:
            raise AuthError("garbled auth header (not msgpack)") from None
        if not (type(fields) is list and len(fields) == 7 and fields[0] == _VERSION):
            claimed = fields[1] if type(fields) is list and len(fields) > 1 and type(fields[1]) is str else None
            raise AuthError("garbled auth header (wrong layout or version)", claimed)
        _, sender, to, session, seq, ts, lens = fields
        if not (type(sender) is str and type(to) is str and type(session) is bytes and type(seq) is int
                and type(ts) is float and type(lens) is list):
            raise AuthError("garbled auth header (field types)", sender if type(sender) is str else None)
        rest = frames[1:]
        actual = [n - start, *(memoryview(f).nbytes for f in rest)] if rest else [n - start]
        if lens != actual:
            raise AuthError(f"frame lengths {actual} do not match the signed {lens} (truncated or spliced)", sender)
        if not hmac.compare_digest(_mac(self._base, first[MAC_BYTES:], rest), first[:MAC_BYTES]):
            raise AuthError("bad signature (wrong secret or tampered frames)", sender)
        if to not in self.receivers and to != "*":
            raise AuthError(f"addressed to {to!r}, this receiver is {sorted(self.receivers)}", sender)
        key = (sender, session)
        last = self._last_seq.get(key)
        if last is not None:
            if seq <= last:
                raise AuthError(f"replayed or duplicated message (seq {seq} <= last accepted {last})", sender)
            self._last_seq.move_to_end(key)
        elif abs(time.time() - ts) > self.max_age:
            raise AuthError(f"stale message from an unknown session (timestamp {time.time() - ts:.1f}s off, "
                            f"max_age={self.max_age}s)", sender)
        self._last_seq[key] = seq
        if len(self._last_seq) > self.max_sessions:
            self._last_seq.popitem(last=False)
        return Envelope(sender, to, session, seq, ts), [first[start:], *rest]
