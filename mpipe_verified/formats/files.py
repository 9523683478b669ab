"""Reading an input file's text: one place for the errors every reader reports the same
way (a missing file, a directory, an unreadable one, too many bytes, bytes that are not
UTF-8), each an ``InputError`` naming the file (and the line of a bad byte)."""

from __future__ import annotations

import os

from ..errors import InputError

MAX_BYTES = 1 << 28  # far above any real schedule; stops /dev/zero-like inputs


def read_text(path: str | os.PathLike[str], expected: str,
              max_bytes: int | None = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, of at most ``max_bytes`` (None: no bound); errors say
    ``expected`` (e.g. ``"a torch CSV file"``)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError("no such file", name) from None
    except IsADirectoryError:
        raise InputError(f"is a directory, expected {expected}", name) from None
    except OSError as e:
        raise InputError(f"cannot read file: {e.strerror or e}", name) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise InputError(f"file larger than {max_bytes} bytes; expected {expected}", name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"not UTF-8 text (byte 0x{data[e.start]:02x}); expected {expected}",
                         name, line) from None
