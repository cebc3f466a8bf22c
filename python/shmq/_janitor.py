"""shmq's janitor: removes a process's segments once that process is gone, however it
ended (SIGKILL, a signal's default action, a crash, ``os._exit``).

A process that creates a segment starts one janitor (:func:`start`, called by
``shmq._cleanup`` on its first segment): a separate, small Python process that holds one
end of a ``SOCK_SEQPACKET`` socket pair whose other end only the owner holds. The core
(``segment::set_janitor``) sends it ``+name`` for every segment or socket directory the
owner creates and ``-name`` for every one the owner removes itself. When the owner's end
is closed — the owner exited, normally or not, and no process it forked still holds the
socket — the janitor reads end-of-file, removes the names still listed and exits. This is
the design of ``multiprocessing``'s resource tracker, which is what removes vLLM's own
queue segments after its shutdown SIGKILLs the engine.

What it changes for the host program, and why each is harmless:

- One extra process per process that creates segments, ~10 MB and no CPU while its
  owner lives (it sleeps in ``recv``). It is started detached (its own session, and its
  first parent — a ``/bin/sh`` that puts it in the background, ~2 ms; where there is no
  ``/bin/sh``, the janitor's own interpreter, which forks — exits at once, so the owner
  never sees it as a child and waits only for that first parent, not for an interpreter
  to start: no ``wait()`` of the
  host reaps it, no ``SIGCHLD`` from it, and a tree kill of the owner's children — vLLM's
  shutdown does one — does not stop it before it has cleaned up). It ends when its owner
  does. It ignores ``SIGINT`` (a Ctrl-C reaches only the terminal's process group, not
  its session anyway) and dies of ``SIGTERM`` as any process.
- It runs ``python -I -S``: no site-packages, no user code, no environment variables
  beyond the interpreter's own; it imports only the standard library.
- It removes only names that start with shmq's prefix, in ``/dev/shm``, that its owner
  sent: names carry the owner's pid and random bits, so nobody else has one.

Where no interpreter can be started (``sys.executable`` empty, as in some embedders), no
janitor runs; exit cleanup still removes what a process made when it ends normally, and
``python -m shmq cleanup`` removes what a killed one left.

``SHMQ_NO_JANITOR=1`` in a process's environment starts none there (a sandbox that
allows no extra process, say): its segments are then left behind by a death without
exit hook, for ``cleanup``, as before the janitor.

Run as a script: ``python -I -S _janitor.py FD PREFIX SHM_DIR``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


#: Set to ``1`` to start no janitor in this process (see the module docs).
DISABLE_ENV = "SHMQ_NO_JANITOR"


def _remove(name: str, prefix: str, shm_dir: str) -> None:
    if name.startswith("/"):
        # A socket directory: `<shm_dir>/<prefix>...`, holding socket files only.
        if not name.startswith(os.path.join(shm_dir, prefix)) or "/" in name[len(shm_dir) + 1 :]:
            return
        try:
            for entry in os.scandir(name):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
            os.rmdir(name)
        except OSError:
            pass
    elif name.startswith(prefix) and "/" not in name:
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            pass


def _serve(fd: int, prefix: str, shm_dir: str) -> None:
    """Listen to the owner until it is gone, then remove what it left."""
    listed: set[str] = set()
    with socket.socket(fileno=fd) as sock:
        while True:
            try:
                message = sock.recv(4096)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            except OSError:
                break
            if not message:
                break
            name = message[1:].decode("utf-8", "replace")
            if message[:1] == b"+":
                listed.add(name)
            elif message[:1] == b"-":
                listed.discard(name)
    for name in sorted(listed, key=lambda n: n.startswith("/")):
        _remove(name, prefix, shm_dir)


def _main(argv: list[str]) -> None:
    fd, prefix, shm_dir = int(argv[1]), argv[2], argv[3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # Detach: the first process exits at once (its parent reaps it), the second is
    # nobody's child in the owner's tree.
    if os.fork() != 0:
        os._exit(0)
    os.chdir("/")
    _serve(fd, prefix, shm_dir)


_SH = "/bin/sh"


def start(executable: str | None = None) -> bool:
    """Start this process's janitor (see the module docs) unless it has one. False where
    none could be started (the caller goes on without it)."""
    from . import _core

    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if _core.has_janitor():
        return True
    python = executable if executable is not None else sys.executable
    if not python or not os.access(python, os.X_OK):
        return False
    theirs = _core.new_janitor_socket()
    command = [python, "-I", "-S", os.path.abspath(__file__), str(theirs), _core.segment_prefix, _core.SHM_DIR]
    if os.access(_SH, os.X_OK):
        # The shell starts the janitor in the background and exits: the owner waits for
        # a shell (~2 ms), not for an interpreter to start (~30-70 ms). The janitor's
        # socket is already its own: what the owner sends meanwhile waits in the socket.
        command = [_SH, "-c", '"$@" </dev/null >/dev/null &', "sh", *command]
    try:
        first = subprocess.Popen(
            command,
            pass_fds=(theirs,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        # It forks and exits at once; reap it here so that it is no zombie of ours.
        first.wait(timeout=30)
        return first.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.close(theirs)


if __name__ == "__main__":
    _main(sys.argv)
