"""Run untrusted (model-written) programs in a bubblewrap sandbox with resource limits.

Why bubblewrap: it is the well-kept unprivileged sandbox of Flatpak (Debian package
``bubblewrap``); it gives each run its own namespaces -- no network at all (a new network
namespace, loopback down), its own PID space (nothing outside is visible or signalable,
and when the program ends every process it started dies with the namespace), a filesystem
that shows only the interpreter's read-only system directories, a fresh ``/proc`` and
``/dev``, a size-capped writable scratch directory -- and a scrubbed environment (no
secrets).  rlimits bound CPU time, address space, processes and file size; the caller
bounds wall time and output.  When run as root the sandbox drops to a per-slot unprivileged
uid, so the process limit is enforced (the kernel does not apply it to root) and one run's
processes never count against another's.

Fail closed: without a working ``bwrap`` every call raises :class:`SandboxUnavailable`
with how to install it, unless the caller explicitly passes ``allow_unsandboxed=True``.
"""
from __future__ import annotations

import functools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_program", "sandbox_status",
           "INSTALL_HINT"]

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"
_UID_BASE = 200_000  # root: slot k runs as uid/gid _UID_BASE + k (no other process uses them)
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per run.  Output beyond ``output_bytes`` (per stream) is cut off and the program killed."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 256  # address space of each process (x processes bounds the total)
    processes: int = 16
    file_size_mb: int = 8  # largest file the program may write
    scratch_mb: int = 16  # the writable scratch directory (a tmpfs) in all
    output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "file_size_mb", "scratch_mb", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r} must be > 0")


@dataclass
class SandboxResult:
    """How a run ended.  ``ok``: exit code 0 within every limit; else ``reason`` says why not."""

    ok: bool
    reason: str  # "" when ok
    exit_code: Optional[int]
    stdout: str
    stderr: str
    duration_s: float
    sandboxed: bool


@functools.lru_cache(maxsize=None)
def _interpreter() -> str:
    """A Python every uid can run (the sandbox binds only system directories)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise SandboxUnavailable("no system Python (/usr/bin/python3) to run sandboxed programs with")


_status_lock = threading.Lock()
_status_ok = False


def sandbox_status() -> str:
    """"" when sandboxing works here, else why not.

    Probing starts a sandbox, so it runs once per process at a time (under a lock) and a
    success is remembered. A failure is not: it can be transient -- the threads of several
    processes probing at once under one uid hit the process limit (``Can't fork for pid 1``)
    -- and a remembered one turned every later reward of that process into an error. The
    probe's slot depends on the process, so processes starting together do not share a uid.
    """
    global _status_ok
    if _status_ok:
        return ""
    with _status_lock:
        if _status_ok:
            return ""
        if shutil.which("bwrap") is None:
            return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
        try:
            res = _run("print(6 * 7)", "", SandboxLimits(wall_s=20), slot=os.getpid() % 1000, sandboxed=True)
        except (OSError, SandboxUnavailable) as e:
            return f"bubblewrap cannot start a sandbox here: {e}"
        if res.stdout.strip() != "42":
            return f"bubblewrap cannot start a sandbox here: {res.reason or 'no output'} {res.stderr[-300:]}".strip()
        _status_ok = True
        return ""


def _forget_status() -> None:
    """Probe again on the next call (tests that change the environment use it)."""
    global _status_ok
    _status_ok = False


sandbox_status.cache_clear = _forget_status  # type: ignore[attr-defined]  (the name of the former lru_cache's)


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *, slot: int = 0,
                allow_unsandboxed: bool = False) -> SandboxResult:
    """Run Python ``code`` with ``stdin`` in a fresh sandbox; never raises for what the program does.

    ``slot`` (0..999) separates concurrent runs (their own uid when running as root).
    ``allow_unsandboxed``: where bubblewrap does not work, run as a plain subprocess with the
    same rlimits instead of raising -- only for trusted code.
    """
    problem = sandbox_status()
    if problem and not allow_unsandboxed:
        raise SandboxUnavailable(problem + " (or opt out explicitly: allow_unsandboxed / sandbox=off)")
    return _run(code, stdin, limits, slot=slot, sandboxed=not problem)


# ---------------------------------------------------------------- one run


def _bwrap_argv(src_dir: str, limits: SandboxLimits) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(limits.scratch_mb << 20), "--tmpfs", "/tmp",
             "--size", str(limits.scratch_mb << 20), "--tmpfs", "/sandbox",
             "--ro-bind", src_dir, "/program", "--chdir", "/sandbox",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
             "--setenv", "PYTHONHASHSEED", "0"]
    return argv


def _limits_preexec(limits: SandboxLimits, uid: Optional[int]):
    def apply() -> None:
        os.setsid()  # its own process group: the wall-time kill reaches every process
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mb, limits.file_size_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # +2: bwrap's own init and the program's first process count too
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes + 2, limits.processes + 2))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return apply


_DIR_PREFIX = "rf_sandbox_"


@functools.lru_cache(maxsize=None)
def _sweep_orphans() -> int:
    """Remove program directories left by processes that died before their ``finally`` ran
    (a killed reward worker); once per process. A directory is named for its creator's pid,
    and only those of pids that no longer exist are removed. Returns how many were."""
    removed = 0
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid_text = name[len(_DIR_PREFIX):].split("_", 1)[0] if name.startswith(_DIR_PREFIX) else ""
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive (or another user's, which we may not signal): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed += 1
    return removed


def _run(code: str, stdin: str, limits: SandboxLimits, *, slot: int, sandboxed: bool) -> SandboxResult:
    if not 0 <= slot < 1000:
        raise ValueError(f"slot={slot}: must be in [0, 1000)")
    _sweep_orphans()
    src_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}_")
    try:
        os.chmod(src_dir, 0o755)
        path = os.path.join(src_dir, "main.py")
        with open(path, "w") as f:
            f.write(code)
        os.chmod(path, 0o644)
        uid = _UID_BASE + slot if os.geteuid() == 0 and sandboxed else None
        if sandboxed:
            argv = _bwrap_argv(src_dir, limits) + [_interpreter(), "-I", "-S", "/program/main.py"]
            env = {"PATH": "/usr/bin:/bin"}
            cwd = "/"
        else:
            argv = [_interpreter(), "-I", "-S", path]
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            cwd = src_dir
        return _supervise(argv, env, cwd, stdin, limits, uid, sandboxed)
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)


def _supervise(argv: list[str], env: dict, cwd: str, stdin: str, limits: SandboxLimits,
               uid: Optional[int], sandboxed: bool) -> SandboxResult:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=cwd, preexec_fn=_limits_preexec(limits, uid), close_fds=True)
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    reason = ""
    try:
        try:
            proc.stdin.write(stdin.encode())  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        finally:
            try:
                proc.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
        sel = selectors.DefaultSelector()
        for stream in out:
            sel.register(stream, selectors.EVENT_READ)
        deadline = t0 + limits.wall_s
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f"wall time limit ({limits.wall_s:g} s)"
                break
            for key, _ in sel.select(min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = out[key.fileobj]  # type: ignore[index]
                buf += chunk
                if len(buf) > limits.output_bytes:
                    del buf[limits.output_bytes:]
                    reason = f"output limit ({limits.output_bytes} bytes)"
                    break
            if reason:
                break
        if reason:
            _kill_group(proc)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reason = reason or f"wall time limit ({limits.wall_s:g} s)"
            _kill_group(proc)
            proc.wait(timeout=10)
    finally:
        for stream in out:
            stream.close()  # type: ignore[union-attr]
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait(timeout=10)
    rc = proc.returncode
    stderr = out[proc.stderr].decode(errors="replace")
    if not reason and rc != 0:
        reason = _why(rc, stderr, limits)
    return SandboxResult(ok=not reason and rc == 0, reason=reason, exit_code=rc,
                         stdout=out[proc.stdout].decode(errors="replace"), stderr=stderr,
                         duration_s=time.monotonic() - t0, sandboxed=sandboxed)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap and (outside a sandbox) everything the program started
    except ProcessLookupError:
        pass


def _why(rc: int, stderr: str, limits: SandboxLimits) -> str:
    """A one-line reason for a failed run, from its exit status and the end of its stderr."""
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if rc < 0 or rc > 128:
        sig = -rc if rc < 0 else rc - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "CPU" in tail):
            return f"CPU time limit ({limits.cpu_s} s)"
        if sig == signal.SIGXFSZ:
            return f"file size limit ({limits.file_size_mb} MB)"
        return f"killed by {name}" + (f": {tail}" if tail else "")
    # the last lines, not only the last one: a program's children (a fork bomb's) interleave
    # their tracebacks, so the line naming the error is often not the final line
    recent = "\n".join(stderr.strip().splitlines()[-20:])
    if "File too large" in recent:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
        return f"file size limit ({limits.file_size_mb} MB): {tail}"
    if "MemoryError" in recent:
        return f"memory limit ({limits.memory_mb} MB): {tail}"
    if "BlockingIOError" in recent or "Resource temporarily unavailable" in recent:
        return f"process limit ({limits.processes}): {tail}"
    return f"exit code {rc}" + (f": {tail[:300]}" if tail else "")
