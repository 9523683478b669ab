"""Progress for long runs: phases on one status line of stderr, only on a terminal.

``Progress()`` is silent unless ``sys.stderr.isatty()`` (so CI logs, pipes and captured
output never see it). ``phase(text)`` replaces the status line; ``done()`` clears it
before the result is printed.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None,
                 prefix: str = "mpipe-verify") -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            try:
                enabled = self.stream.isatty()
            except (AttributeError, ValueError):
                enabled = False
        self.enabled, self.prefix, self._shown = enabled, prefix, False

    def phase(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write(f"\r\x1b[K{self.prefix}: {text}…")
        self.stream.flush()
        self._shown = True

    def done(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False
