"""One flow per work dir: a second run of the same profile exits at once, saying who holds it.

Why: two flows in one work dir break each other. Without a lock the second one only dies at its
first DVC lock, and on the way its stale-run cleanup marks the *live* flow's MLflow runs KILLED. A
lock taken before anything else is touched makes the second flow leave straight away with
"another run of profile X is in progress (pid, started at)".

The lock is an exclusive ``flock`` on ``<workdir>/.apprentice-run.lock``. The kernel drops it the
moment its holder dies, even on ``kill -9``, so a crashed run never leaves a stale lock: the file
that remains is only a note. Who holds the lock (pid, host, profile, start time) is written into
the file after it is taken, so the refusal can name the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".apprentice-run.lock"


class RunInProgress(RuntimeError):
    """Another run holds this work dir's lock; the message names it."""


@contextlib.contextmanager
def hold(workdir: Path, profile: str) -> Iterator[dict[str, object]]:
    """Hold the work dir's run lock for the block; raise :class:`RunInProgress` at once if it is taken."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    fh = open(path, "a+")  # noqa: SIM115 - held for the whole block
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            try:
                who = json.loads(fh.read() or "{}")
            except json.JSONDecodeError:
                who = {}
            raise RunInProgress(
                f"another run of profile {who.get('profile', profile)} is in progress "
                f"(pid {who.get('pid', '?')} on {who.get('host', '?')}, started at {who.get('started_at', '?')}); "
                f"wait for it to finish or stop it (lock: {path})") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "profile": profile,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(me))
        fh.flush()
        yield me
    finally:
        fh.close()  # releases the flock
