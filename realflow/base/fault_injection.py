"""Test-only fault injection: a process of a run kills itself at a chosen point of its own work.

Why: the recovery tests used to kill a worker from outside at a moment picked by watching
the run's files. The run goes on while the test looks, so the kill landed somewhere
different on every run, and once after a 9-step run had already finished. Here the victim
itself dies when it reaches the k-th occurrence of an event of its own, so the fault lands
at the same place of the run every time, however fast or loaded the host is.

    REALFLOW_FAULT_INJECT="<process>@<event>=<k>[:<signal>]"

``<process>`` is a worker name as the launcher gives it ($REALFLOW_ROLE: ``master``,
``model_worker/1``, ``gen_server/0``, ...), ``<event>`` one of :data:`EVENTS` (each belongs
to one kind of process), ``<k>`` an integer >= 1 and ``<signal>`` a signal name (default
SIGKILL; e.g. SIGSTOP to freeze the process instead). Examples::

    model_worker/1@train_step=10    master@step=13    rollout_worker/0@rollout=57
    gen_server/0@generate=25        model_worker/0@train_step=3:SIGSTOP

The variable reaches every worker as any REALFLOW_* variable does: the local and Slurm
launchers start children with the launcher's environment, the Ray launcher forwards
REALFLOW_* variables.

It fires once per run directory, not once per process: just before the signal the process
creates ``<run_dir>/logs/fault_injected.json`` (exclusively; it records who, where and when,
so a test can time what follows from it). A process that finds that file never fires. A
marker in the run directory, rather than an attempt number exported by the launcher, also
covers the restarts that are no new attempt (a generation server replaced in place by the
launcher counts its requests from 1 again and would die once more), and any launcher,
since every node sees the run directory. The run directory is the one holding the run's
secret file ($REALFLOW_SECRET_FILE, which the launcher gives every process of every attempt).

Unset, it costs nothing: the variable is read once at import, and :func:`fault_point`
returns at its first comparison in every process it does not name.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import time
from typing import Mapping, Optional

from realflow.base.logging import get_logger

logger = get_logger("fault_injection")

ENV = "REALFLOW_FAULT_INJECT"
GRAMMAR = "<process>@<event>=<k>[:<signal>] (e.g. model_worker/0@train_step=5 or master@step=3:SIGSTOP)"
MARKER = os.path.join("logs", "fault_injected.json")

#: event -> (the kind of process that reaches it, where exactly it fires)
EVENTS: dict[str, tuple[str, str]] = {
    "step": ("master", "a training step is done: stats logged, its recover point (if due) written"),
    "finished": ("master", "the run is done: finish recorded, recover points cleared"),
    "train_step": ("model_worker", "a train MFC has updated this worker's model, before it replies"),
    "rollout": ("rollout_worker", "a rollout is about to be delivered to the trainer (k-1 were)"),
    "generate": ("gen_server", "a /generate request has arrived, before it is generated"),
}

_SPEC = re.compile(r"(?P<process>[a-z_]+(?:/\d+)?)@(?P<event>[a-z_]+)=(?P<k>\d+)(?::(?P<signal>[A-Za-z0-9]+))?")


@dataclasses.dataclass
class Fault:
    process: str
    event: str
    k: int
    signal: signal.Signals
    text: str  # the variable's value, for messages
    run_dir: Optional[str] = None
    _seen: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1), repr=False)


def parse(text: str) -> Fault:
    """The fault ``text`` names; ValueError (one line: the variable, the grammar, the problem)."""
    m = _SPEC.fullmatch(text.strip())

    def bad(why: str) -> ValueError:
        return ValueError(f"{ENV}={text!r}: expected {GRAMMAR}; {why}")

    if m is None:
        raise bad("it does not match")
    process, event, k, sig = m["process"], m["event"], int(m["k"]), m["signal"] or "SIGKILL"
    if event not in EVENTS:
        raise bad(f"unknown event {event!r} (events: {', '.join(sorted(EVENTS))})")
    kind = EVENTS[event][0]
    if process.split("/")[0] != kind:
        raise bad(f"event {event!r} happens in {kind} processes, not in {process}")
    if k < 1:
        raise bad(f"k={k} must be >= 1")
    name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
    if name not in signal.Signals.__members__:
        raise bad(f"unknown signal {sig!r}")
    return Fault(process, event, k, signal.Signals[name], text.strip())


def arm(environ: Mapping[str, str]) -> Optional[Fault]:
    """The fault this process must inject, or None (unset, another process, or fired already)."""
    text = environ.get(ENV)
    if not text:
        return None
    fault = parse(text)
    if environ.get("REALFLOW_ROLE") != fault.process:
        return None
    secret = environ.get("REALFLOW_SECRET_FILE")
    if not secret:
        raise ValueError(f"{ENV}={text!r}: {fault.process} has no REALFLOW_SECRET_FILE, so no run directory to "
                         "mark the fault as done in (start it with the launcher)")
    fault.run_dir = os.path.dirname(os.path.abspath(secret))
    if os.path.exists(os.path.join(fault.run_dir, MARKER)):  # an earlier attempt or instance fired it
        return None
    return fault


_FAULT: Optional[Fault] = arm(os.environ)


def fault_point(event: str) -> None:
    """Called where this process reaches ``event``; at the k-th time in the named process, fires."""
    if _FAULT is None or event != _FAULT.event:
        return
    if next(_FAULT._seen) == _FAULT.k:
        fire(_FAULT)


def fire(fault: Fault) -> bool:
    """Mark the run, then send this process ``fault.signal``; False if the run was marked already."""
    global _FAULT
    _FAULT = None  # at most once per process, whatever happens below
    path = os.path.join(fault.run_dir, MARKER)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    logger.warning(f"fault injection ({ENV}={fault.text}): {fault.process} sends itself {fault.signal.name} "
                   f"at {fault.event} {fault.k}")
    # the time is taken last, as close to the signal as it can be: tests time what follows from it.
    # (no fsync: what a killed process wrote is in the page cache, only a crash of the host loses it)
    record = {"process": fault.process, "event": fault.event, "k": fault.k, "signal": fault.signal.name,
              "pid": os.getpid(), "time": time.time(), ENV: fault.text}
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.kill(os.getpid(), fault.signal)
    return True


def fired(run_dir: str) -> Optional[dict]:
    """What the marker of ``run_dir`` says (who fired what, ``time`` of the signal), None if none fired."""
    try:
        with open(os.path.join(run_dir, MARKER)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
