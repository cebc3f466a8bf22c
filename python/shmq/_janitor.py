"""shmq's janitor: removes a process's segments once that process is gone, however it
ended (SIGKILL, a signal's default action, a crash, ``os._exit``).

A process that creates a segment starts one janitor (:func:`start`, called by
``shmq._cleanup`` on its first segment): a small detached ``python -I -S`` process that
holds one end of a ``SOCK_SEQPACKET`` socket pair whose other end only the owner holds.
The core (``segment::set_janitor``) sends it ``+name`` for every segment or socket
directory the owner creates and ``-name`` for every one the owner removes itself; at
end-of-file (the owner is gone) it removes the names still listed, each only while the
file is still the one its owner made (device and inode), and exits. ``~name``, with a
descriptor of another segment's file (``SCM_RIGHTS``), hands it a name to remove once no
process holds a lock on that file: a queue's tensor arena that must outlive a writer
that ended normally until the queue's readers (who hold their role locks on its ring)
have left or died, so that no message they were sent is lost. It waits for those in
threads of their own (blocked in the kernel, no CPU) and exits once they are done.

``SHMQ_NO_JANITOR=1`` in a process's environment starts none there; nor does an empty
``sys.executable``. ``python -m shmq cleanup`` removes what is left then.

Run as a script: ``python -I -S _janitor.py FD SHM_DIR [--in-background]``. Why it is
a process of its own, how it is started and why that is harmless to the host:
docs/design.md ("Exit cleanup and the janitor").
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import stat
import subprocess
import sys
import threading


#: Set to ``1`` to start no janitor in this process (see the module docs).
DISABLE_ENV = "SHMQ_NO_JANITOR"


def _same_file(path: str, identity: tuple[int, int], directory: bool) -> bool:
    """Whether ``path`` is still the file (or directory) its owner made: the same device
    and inode, and not a symlink (``lstat``: a symlink put in its place is never
    followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind and (st.st_dev, st.st_ino) == identity


def _remove(name: str, identity: tuple[int, int], shm_dir: str) -> None:
    """Remove ``name`` (a segment in ``shm_dir``, or the absolute path of a socket
    directory directly in it) if it is still the one its owner made."""
    if name.startswith("/"):
        # A socket directory: `<shm_dir>/<name>`, holding socket files only.
        if not name.startswith(shm_dir + "/") or "/" in name[len(shm_dir) + 1 :]:
            return
        if not _same_file(name, identity, directory=True):
            return
        try:
            for entry in os.scandir(name):
                try:
                    os.unlink(entry.path)  # unlink never follows a symlink
                except OSError:
                    pass
            os.rmdir(name)
        except OSError:
            pass
    elif name and "/" not in name and name not in (".", ".."):
        path = os.path.join(shm_dir, name)
        # The window between this check and the unlink is a few microseconds: a successor
        # must remove the old file (its creator proved dead) and make its own in it.
        if _same_file(path, identity, directory=False):
            try:
                os.unlink(path)
            except OSError:
                pass


def _parse(message: bytes) -> tuple[str, str, tuple[int, int]] | None:
    """``(op, name, (dev, ino))`` of ``+DEV:INO:name``, ``~DEV:INO:name`` or ``-name``;
    None if malformed."""
    op, rest = message[:1], message[1:].decode("utf-8", "replace")
    if op == b"-":
        return "-", rest, (0, 0)
    if op not in (b"+", b"~"):
        return None
    dev, ino, name = (rest.split(":", 2) + ["", ""])[:3]
    if not (dev.isdigit() and ino.isdigit() and name):
        return None
    return op.decode(), name, (int(dev), int(ino))


def _remove_once_unlocked(name: str, identity: tuple[int, int], shm_dir: str, fd: int) -> None:
    """Wait until no process holds a lock on ``fd``'s file (a queue's ring: its readers
    hold their role locks there until they leave or die), then remove ``name`` if it is
    still the file its owner made. The wait is the kernel's (a blocking whole-file lock):
    no CPU, and it ends the moment the last holder goes, however it goes."""
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            except OSError:
                return  # cannot wait on it (EDEADLK, ENOLCK): leave the name to cleanup
        _remove(name, identity, shm_dir)
    finally:
        os.close(fd)


def _serve(fd: int, shm_dir: str) -> None:
    """Listen to the owner until it is gone, then remove what it left."""
    listed: dict[str, tuple[int, int]] = {}
    waits: list[threading.Thread] = []
    with socket.socket(fileno=fd) as sock:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            except OSError:
                break
            if not message:
                break
            parsed = _parse(message)
            if parsed is None or (parsed[0] == "~") != bool(fds):
                for passed in fds:
                    os.close(passed)
                continue
            op, name, identity = parsed
            if op == "+":
                listed[name] = identity
            elif op == "~":
                # Its owner leaves it to us, to remove once the file passed with it is
                # unlocked (`segment/created.rs`'s `hand_to_janitor`): at once, in a
                # thread of its own that this process waits for before it ends.
                listed.pop(name, None)
                wait = threading.Thread(target=_remove_once_unlocked, args=(name, identity, shm_dir, fds[0]))
                wait.start()
                waits.append(wait)
            else:
                listed.pop(name, None)
    # Segments first, then their socket directories.
    for name in sorted(listed, key=lambda n: n.startswith("/")):
        _remove(name, listed[name], shm_dir)


#: The last argument when a shell started the janitor in the background: it is detached
#: already (the shell, its parent, has exited), so it does not fork again.
IN_BACKGROUND = "--in-background"


def _main(argv: list[str]) -> None:
    fd, shm_dir = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # Detach: the first process exits at once (its parent, the owner, reaps it), the
    # second is nobody's child in the owner's tree. Started by a shell in the background,
    # it is detached already: a second process here would exit unreaped where the owner
    # is a subreaper (orphans are given to it, and it reaps only its own children).
    if argv[-1] != IN_BACKGROUND and os.fork() != 0:
        os._exit(0)
    os.chdir("/")
    _serve(fd, shm_dir)


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
    command = [python, "-I", "-S", os.path.abspath(__file__), str(theirs), _core.SHM_DIR]
    if os.access(_SH, os.X_OK):
        # The shell starts the janitor in the background and exits: the owner waits for
        # a shell to fork, not for an interpreter to start. The janitor's
        # socket is already its own: what the owner sends meanwhile waits in the socket.
        command = [_SH, "-c", '"$@" </dev/null >/dev/null &', "sh", *command, IN_BACKGROUND]
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
