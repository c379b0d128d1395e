"""Keyed-BLAKE2b signing of multi-frame messages with a per-experiment secret.

Why: every process of an experiment shares one secret; anything on the control
plane that is not signed with it (a stray client, a port scanner, a process of
another experiment that reused a port) is dropped before it is decoded.

Signed message layout (what goes on the wire after ZMQ's own routing frames)::

    [mac(32) + fixed header + sender + to + extra frame lengths + payload_frame_1, payload_frame_2, ...]

    fixed header = little-endian struct: version u8, len(sender) u8, len(to) u8,
                   number of extra frames u32, session 8 bytes, seq u64, timestamp f64
    extra frame lengths = one u64 per payload frame after the first
    mac = BLAKE2b-256(key=secret, person="realflow/ctl/v2") over everything after the
          mac in the first frame, then every later frame

(the MAC covers everything after itself, so the first frame is hashed in place, without joining.)

Why keyed BLAKE2b and a fixed struct header: a control message is a few hundred
bytes, so what it costs is Python work, not hashing. BLAKE2's keyed mode is a MAC by
design (RFC 7693; hashlib documents it as a faster replacement for HMAC), its
copy/update/digest are single C calls, and a ``struct`` header parses in one call
where a msgpack header needed unpacking plus a type check per field. On the dispatch
round trip that is most of what signing and verifying cost (see
``benchmarks/bench_dispatch.py``). The personalization string separates these MACs
from any other use of the secret.

The header carries the number and lengths of the later frames, so moving bytes
between frames or dropping/adding a frame breaks the MAC. MAC, header and the first
payload frame (the small codec header) share one ZMQ frame because every extra frame
costs ~10 us per round trip; later payload frames (tensor buffers) stay separate and
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

__all__ = [
    "SECRET_ENV", "AuthError", "Envelope", "Signer", "Verifier",
    "new_secret", "http_token", "secret_to_hex", "secret_from_env", "check_secret",
]

SECRET_ENV = "REALFLOW_SECRET"
SECRET_FILE_ENV = "REALFLOW_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
_VERSION = 2
_PERSON = b"realflow/ctl/v2"
#: version, len(sender), len(to), number of extra frames, session, seq, timestamp
_FIXED = struct.Struct("<BBBI8sQd")
_PREFIX = MAC_BYTES + _FIXED.size  # where the sender's name starts in the first frame
_MAX_NAME_BYTES = 255


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


def http_token(secret: bytes) -> str:
    """The bearer token of an experiment's HTTP services (gen servers, rollout controller).

    Derived from the secret with a separate personalization, so the token (which an
    HTTP client sends in clear on loopback) never reveals the control plane's MAC key.
    """
    return hashlib.blake2b(b"http-bearer", key=check_secret(secret)[:64], digest_size=24,
                           person=b"realflow/http/v1").hexdigest()


def secret_to_hex(secret: bytes) -> str:
    return check_secret(secret).hex()


def check_secret(secret: Any) -> bytes:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required")
    return bytes(secret)


def secret_from_env(var: str = SECRET_ENV, environ: Mapping[str, str] | None = None) -> bytes:
    """The experiment secret: from the 0600 file named by ``REALFLOW_SECRET_FILE`` (what the
    launcher uses: the environment of every child process, and /proc/<pid>/environ, then
    hold only a path), else hex from ``REALFLOW_SECRET`` (tests and hand-started workers)."""
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path) as f:
                value, var = f.read(), f"{SECRET_FILE_ENV}={path}"
        except OSError as e:
            raise KeyError(f"cannot read the experiment secret from {SECRET_FILE_ENV}={path}: {e.strerror}") from None
    else:
        value = env.get(var)
    if not value:
        raise KeyError(f"environment variable {var} is not set; the launcher must export the experiment "
                       f"secret as hex (realflow.comm.auth.secret_to_hex(new_secret())) or name a file "
                       f"holding it in {SECRET_FILE_ENV}")
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        raise ValueError(f"{var} is not valid hex ({len(value)} characters)") from None
    try:
        return check_secret(secret)
    except ValueError as e:
        raise ValueError(f"{var}: {e}") from None


def write_secret_file(path: str, secret: bytes) -> str:
    """Write ``secret`` as hex to a new file readable by this user only (0600, created so: never
    world-readable even for an instant); returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret.hex().encode())
    finally:
        os.close(fd)
    return path


class Envelope(NamedTuple):
    """The verified auth header of a message (a named tuple: built per message, so it must be cheap)."""

    sender: str
    to: str
    session: bytes
    seq: int
    ts: float


def _mac_base(secret: bytes) -> Any:
    """A BLAKE2b-256 object keyed with the secret: copied per message, so the key block is hashed once.

    BLAKE2b keys are at most 64 bytes; a longer secret is hashed down to 64 bytes first.
    """
    key = secret if len(secret) <= 64 else hashlib.blake2b(secret, digest_size=64, person=_PERSON).digest()
    return hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=_PERSON)


def _name_bytes(name: str, what: str) -> bytes:
    b = name.encode()
    if len(b) > _MAX_NAME_BYTES:
        raise ValueError(f"{what} name {name!r} is {len(b)} bytes in UTF-8; at most {_MAX_NAME_BYTES} are allowed")
    return b


def _nbytes(f: Any) -> int:
    return len(f) if type(f) is bytes else memoryview(f).nbytes


class Signer:
    """Signs outgoing messages of one sender (one socket: sequence numbers must stay ordered)."""

    def __init__(self, secret: bytes, sender: str) -> None:
        self._base = _mac_base(check_secret(secret))
        self.sender = sender
        self._sender_b = _name_bytes(sender, "sender")
        self.session = os.urandom(8)
        self._seq = itertools.count(1)
        self._names: dict[str, tuple[int, bytes]] = {}  # to -> (len(to in bytes), sender + to bytes)

    def sign(self, frames: Sequence[Any], to: str) -> list[Any]:
        """Return the signed frames (the first payload frame is copied behind the MAC, the others are not)."""
        if not frames:
            raise ValueError("nothing to sign: at least one payload frame is required")
        names = self._names.get(to)
        if names is None:
            to_b = _name_bytes(to, "receiver")
            names = self._names[to] = (len(to_b), self._sender_b + to_b)
        first, rest = frames[0], frames[1:]
        header = _FIXED.pack(_VERSION, len(self._sender_b), names[0], len(rest), self.session,
                             next(self._seq), time.time()) + names[1]
        if rest:
            header += struct.pack(f"<{len(rest)}Q", *map(_nbytes, rest))
        h = self._base.copy()
        h.update(header)
        h.update(first)
        for f in rest:
            h.update(f)
        return [b"".join((h.digest(), header, first)), *rest]


class Verifier:
    """Verifies incoming messages for one receiver; keeps replay state (not thread-safe)."""

    def __init__(self, secret: bytes, receivers: str | Iterable[str], max_age: float = 120.0,
                 max_sessions: int = 4096) -> None:
        self._base = _mac_base(check_secret(secret))
        self.receivers = frozenset([receivers] if isinstance(receivers, str) else receivers)
        self._receivers_b = frozenset([*(r.encode() for r in self.receivers), b"*"])
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
        if n < _PREFIX:
            raise AuthError(f"unsigned message (first frame is {n} bytes, too short for a MAC + header)")
        version, slen, tlen, n_extra, session, seq, ts = _FIXED.unpack_from(first, MAC_BYTES)
        if version != _VERSION:
            raise AuthError(f"garbled auth header or incompatible peer (version {version}, expected {_VERSION})")
        names_end = _PREFIX + slen + tlen
        start = names_end + 8 * n_extra
        if start > n:
            raise AuthError(f"garbled auth header (claims {slen}+{tlen} name bytes and {n_extra} extra frames "
                            f"in a {n}-byte frame)")
        sender = str(first[_PREFIX:_PREFIX + slen], "utf-8", "replace")
        rest = frames[1:]
        if n_extra != len(rest):
            raise AuthError(f"message has {len(frames)} frames but {n_extra + 1} were signed (truncated or spliced)",
                            sender)
        if n_extra and struct.unpack_from(f"<{n_extra}Q", first, names_end) != tuple(map(_nbytes, rest)):
            raise AuthError(f"frame lengths {[_nbytes(f) for f in rest]} do not match the signed "
                            f"{list(struct.unpack_from(f'<{n_extra}Q', first, names_end))} (truncated or spliced)",
                            sender)
        h = self._base.copy()
        h.update(memoryview(first)[MAC_BYTES:])
        for f in rest:
            h.update(f)
        if not hmac.compare_digest(h.digest(), first[:MAC_BYTES]):
            raise AuthError("bad signature (wrong secret or tampered frames)", sender)
        to_b = bytes(first[_PREFIX + slen:names_end])
        if to_b not in self._receivers_b:
            raise AuthError(f"addressed to {str(to_b, 'utf-8', 'replace')!r}, this receiver is "
                            f"{sorted(self.receivers)}", sender)
        key = (sender, session)
        last = self._last_seq.get(key)
        if last is not None:
            if seq <= last:
                raise AuthError(f"replayed or duplicated message (seq {seq} <= last accepted {last})", sender)
            self._last_seq.move_to_end(key)
        elif not abs(time.time() - ts) <= self.max_age:  # (also refuses a NaN timestamp)
            raise AuthError(f"stale message from an unknown session (timestamp {time.time() - ts:.1f}s off, "
                            f"max_age={self.max_age}s)", sender)
        self._last_seq[key] = seq
        if len(self._last_seq) > self.max_sessions:
            self._last_seq.popitem(last=False)
        return Envelope(sender, str(to_b, "utf-8"), session, seq, ts), [first[start:], *rest]
