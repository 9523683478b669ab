"""Errors that reach the user as one clear line and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad input: names the file, the position (1-based line/row and column) and what was
    expected. ``str(err)`` is the one line the CLI prints."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 column: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.column = column

    def __str__(self) -> str:
        where = self.file or "<input>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.message}"


class ParameterError(ValueError):
    """Invalid family or operator parameters; the message names the failed condition."""


def require(condition: bool, message: str) -> None:
    """Raise ``ParameterError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ParameterError(message)
