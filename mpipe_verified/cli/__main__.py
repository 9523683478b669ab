"""``python -m mpipe_verified.cli``: the ``mpipe-verify`` command."""

from . import console_main

console_main()
