"""Writing report and picture files: atomically, parents created, ``-`` for stdout.

``write_output(path, text)`` writes ``text`` (UTF-8, ``\\n`` line ends) to a temp file in
the target's directory, flushes it to disk and renames it over ``path`` with
``os.replace``: a reader never sees a half-written file and a failed write leaves none.
An existing file's permission bits are kept. A symlink is followed: its target is replaced
atomically and the link stays. A path that exists and is not a regular file (a FIFO, a
device such as ``/dev/stdout`` or ``/dev/null``) is opened and written through, never
replaced; such a write cannot be atomic.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import uuid

STDOUT = "-"


def write_output(path: str | os.PathLike[str], text: str, newline: str = "\n") -> None:
    """Write ``text`` to ``path`` atomically (``-``: standard output); ``newline`` as for
    ``open`` (``""`` keeps the text's own line ends, e.g. CSV's ``\r\n``)."""
    name = os.fspath(path)
    if name == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if os.path.isdir(name):
        raise IsADirectoryError(21, "is a directory, expected a file path", name)
    try:
        special = not stat.S_ISREG(os.stat(name).st_mode)  # follows symlinks
    except FileNotFoundError:
        special = False  # a new file, or a dangling symlink: created below
    if special:
        try:
            with open(name, "w", encoding="utf-8", newline=newline) as out:
                out.write(text)
        except OSError as e:  # e.g. ENOSPC from /dev/full: name the path
            if e.filename is None:
                raise OSError(e.errno, e.strerror, name) from None
            raise
        return
    name = os.path.realpath(name)  # replace a symlink's target, not the link
    parent = os.path.dirname(name) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(name)}.{uuid.uuid4().hex[:12]}.tmp")
    f = open(tmp, "x", encoding="utf-8", newline=newline)
    try:
        with f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, os.stat(name).st_mode & 0o7777)
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
