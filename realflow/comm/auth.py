"""HMAC-SHA256 signing of multi-frame messages with a per-experiment secret.

Why: every process of an experiment shares one secret; anything on the control
plane that is not signed with it (a stray client, a port scanner, a process of
another experiment that reused a port) is dropped before it is decoded.

Signed message layout (what goes on the wire after ZMQ's own routing frames)::

    [mac(32 bytes) + len(auth_header)(u16 LE) + auth_header + payload_frame_1, payload_frame_2, ...]

    auth_header = msgpack [version, sender, to, session, seq, ts, [len(payload_frame_i)...]]
    mac         = HMAC-SHA256(secret, auth_header || payload_frame_1 || ... || payload_frame_n)

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
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

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


@dataclass(frozen=True)
class Envelope:
    """The verified auth header of a message."""

    sender: str
    to: str
    session: bytes
    seq: int
    ts: float


_ONE_SHOT_MAX = 64 * 1024  # below this, joining the bytes and one C call beats incremental updates


def _mac(key: bytes, base: Any, header: Any, frames: Sequence[Any]) -> bytes:
    """HMAC-SHA256 over ``header || frames...`` (one-shot for small single-frame messages)."""
    if len(frames) == 1 and len(frames[0]) < _ONE_SHOT_MAX:
        return hmac.digest(key, b"".join((header, frames[0])), "sha256")
    h = base.copy()
    h.update(header)
    for f in frames:
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
        return [b"".join((_mac(self._key, self._base, header, frames), len(header).to_bytes(2, "little"), header,
                          frames[0])), *frames[1:]]


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
        first = memoryview(frames[0])
        if first.ndim != 1 or first.format != "B":
            first = first.cast("B")
        if first.nbytes < MAC_BYTES + 2:
            raise AuthError(f"unsigned message (first frame is {first.nbytes} bytes, too short for a MAC + header)")
        mac = first[:MAC_BYTES]
        hlen = int.from_bytes(first[MAC_BYTES:MAC_BYTES + 2], "little")
        if hlen > _MAX_HEADER_BYTES or MAC_BYTES + 2 + hlen > first.nbytes:
            raise AuthError(f"garbled auth header (claims {hlen} bytes)")
        header = first[MAC_BYTES + 2:MAC_BYTES + 2 + hlen]
        try:
            fields = msgpack.unpackb(header, raw=False)
        except Exception:
            raise AuthError("garbled auth header (not msgpack)") from None
        claimed = fields[1] if isinstance(fields, list) and len(fields) > 1 and isinstance(fields[1], str) else None
        if not (isinstance(fields, list) and len(fields) == 7 and fields[0] == _VERSION):
            raise AuthError("garbled auth header (wrong layout or version)", claimed)
        _, sender, to, session, seq, ts, lens = fields
        if not (isinstance(sender, str) and isinstance(to, str) and isinstance(session, bytes)
                and isinstance(seq, int) and isinstance(ts, float) and isinstance(lens, list)):
            raise AuthError("garbled auth header (field types)", claimed)
        payload = [first[MAC_BYTES + 2 + hlen:], *frames[1:]]
        actual = [memoryview(f).nbytes for f in payload]
        if lens != actual:
            raise AuthError(f"frame lengths {actual} do not match the signed {lens} (truncated or spliced)", claimed)
        if not hmac.compare_digest(_mac(self._key, self._base, header, payload), mac):
            raise AuthError("bad signature (wrong secret or tampered frames)", claimed)
        if to not in self.receivers and to != "*":
            raise AuthError(f"addressed to {to!r}, this receiver is {sorted(self.receivers)}", claimed)
        key = (sender, session)
        last = self._last_seq.get(key)
        if last is not None:
            if seq <= last:
                raise AuthError(f"replayed or duplicated message (seq {seq} <= last accepted {last})", claimed)
            self._last_seq.move_to_end(key)
        elif abs(time.time() - ts) > self.max_age:
            raise AuthError(f"stale message from an unknown session (timestamp {time.time() - ts:.1f}s off, "
                            f"max_age={self.max_age}s)", claimed)
        self._last_seq[key] = seq
        if len(self._last_seq) > self.max_sessions:
            self._last_seq.popitem(last=False)
        return Envelope(sender, to, session, seq, ts), payload
