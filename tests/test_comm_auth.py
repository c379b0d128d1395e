"""Message signing: secrets from the environment, tampering, truncation, wrong secret, replay, addressing."""
from __future__ import annotations

import os
import struct
import time

import pytest

from realflow.comm.auth import (SECRET_ENV, AuthError, Signer, Verifier, check_secret, new_secret,
                                secret_from_env, secret_to_hex)

SECRET = new_secret()


def signed(frames, sender="w0", to="master", secret=SECRET):
    return [bytes(memoryview(f)) for f in Signer(secret, sender).sign(frames, to=to)]


def test_secret_helpers():
    s = new_secret()
    assert len(s) == 32 and s != new_secret()
    assert secret_from_env(environ={SECRET_ENV: secret_to_hex(s)}) == s
    with pytest.raises(KeyError, match=SECRET_ENV):
        secret_from_env(environ={})
    with pytest.raises(ValueError, match=f"{SECRET_ENV} is not valid hex"):
        secret_from_env(environ={SECRET_ENV: "zz"})
    with pytest.raises(ValueError, match="at least 16"):
        secret_from_env(environ={SECRET_ENV: "abcd"})
    with pytest.raises(TypeError):
        check_secret("a string secret")


def test_valid_message_verifies():
    v = Verifier(SECRET, "master")
    env, payload = v.verify(signed([b"header", b"x" * 1000]))
    assert env.sender == "w0" and env.to == "master" and env.seq == 1
    assert [bytes(p) for p in payload] == [b"header", b"x" * 1000]


@pytest.mark.parametrize("frame_index, pos", [(0, 5), (0, 40), (0, -1), (1, 3), (1, -1)])  # mac, header, payload
def test_any_flipped_byte_is_rejected(frame_index, pos):
    frames = signed([b"payload-header", b"tensor-bytes"])
    f = bytearray(frames[frame_index])
    f[pos] ^= 0x01
    frames[frame_index] = bytes(f)
    with pytest.raises(AuthError):
        Verifier(SECRET, "master").verify(frames)


def test_wrong_secret_names_claimed_sender():
    with pytest.raises(AuthError, match="bad signature") as ei:
        Verifier(SECRET, "master").verify(signed([b"p"], sender="w7", secret=new_secret()))
    assert ei.value.claimed_sender == "w7"


def test_unsigned_and_garbled():
    v = Verifier(SECRET, "master")

    def frame(version=2, slen=2, tlen=6, n_extra=0, names=b"w0master") -> bytes:
        fixed = struct.pack("<BBBI8sQd", version, slen, tlen, n_extra, b"s" * 8, 1, time.time())
        return b"\x00" * 32 + fixed + names + b"payload"

    for frames, reason in (
        ([], "empty"),
        ([b"just one frame"], "unsigned"),
        ([b"a", b"b", b"c"], "unsigned"),
        ([frame(version=1)], "version"),
        ([frame(slen=200, tlen=200)], "garbled auth header"),
        ([frame(n_extra=1_000_000)], "garbled auth header"),
        ([frame(n_extra=1, names=b"w0master" + b"\0" * 8)], "truncated"),  # one frame signed as two
        ([frame()], "bad signature"),  # well-formed, but the MAC is zeros
    ):
        with pytest.raises(AuthError, match=reason):
            v.verify(frames)


def test_long_secret_and_names():
    long_secret = new_secret(100)  # longer than a BLAKE2b key: hashed down, still verifies
    frames = Signer(long_secret, "w" * 255).sign([b"p"], to="master")
    assert Verifier(long_secret, "master").verify(frames)[0].sender == "w" * 255
    with pytest.raises(AuthError, match="bad signature"):
        Verifier(new_secret(100), "master").verify(frames)
    with pytest.raises(ValueError, match="at most 255"):
        Signer(SECRET, "w" * 256)
    with pytest.raises(ValueError, match="at most 255"):
        Signer(SECRET, "w0").sign([b"p"], to="m" * 256)


def test_truncation_and_splicing():
    v = Verifier(SECRET, "master")
    frames = signed([b"head", b"0123456789"])
    with pytest.raises(AuthError, match="truncated"):
        v.verify(frames[:-1])  # a frame dropped
    with pytest.raises(AuthError, match="truncated"):
        v.verify(frames[:-1] + [frames[-1][:5]])  # a frame cut short
    with pytest.raises(AuthError, match="truncated"):
        v.verify([frames[0] + b"0", frames[1][1:]])  # bytes moved between frames


def test_replay_and_duplicates_rejected():
    signer = Signer(SECRET, "w0")
    v = Verifier(SECRET, "master")
    m1 = signer.sign([b"one"], to="master")
    m2 = signer.sign([b"two"], to="master")
    v.verify(m1)
    with pytest.raises(AuthError, match="replayed"):
        v.verify(m1)
    v.verify(m2)
    with pytest.raises(AuthError, match="replayed"):
        v.verify(m1)  # an older message after a newer one


def test_addressing():
    with pytest.raises(AuthError, match="addressed to 'w1'"):
        Verifier(SECRET, "w2").verify(signed([b"p"], sender="master", to="w1"))
    Verifier(SECRET, "w2").verify(signed([b"p"], sender="master", to="*"))


def test_stale_message_from_unknown_session(monkeypatch):
    frames = signed([b"p"])
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 1000)
    with pytest.raises(AuthError, match="stale"):
        Verifier(SECRET, "master", max_age=120).verify(frames)


def test_secret_file_is_private_and_read_back(tmp_path):
    import stat

    from realflow.comm.auth import SECRET_FILE_ENV, new_secret, secret_from_env, write_secret_file

    secret = new_secret()
    path = write_secret_file(str(tmp_path / ".secret"), secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert secret_from_env(environ={SECRET_FILE_ENV: path}) == secret
    with pytest.raises(KeyError, match=f"{SECRET_FILE_ENV}=.*missing"):
        secret_from_env(environ={SECRET_FILE_ENV: str(tmp_path / "missing")})
