"""Two cores for one command: run a function in a forked child that inherits its
arguments (nothing is pickled on the way in; the child copies only the pages whose
reference counts it touches), while this process does its own share."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


def can_fork() -> bool:
    """Whether this platform can fork (not Windows)."""
    return "fork" in mp.get_all_start_methods()


@contextlib.contextmanager
def forked(run: Callable[..., T], *args) -> Iterator[Callable[[], T]]:
    """``run(*args)`` in a forked child (which inherits ``args``: nothing is pickled on
    the way in); yields a function that waits for its answer (its exception is raised
    here). The child is gone when the block ends."""
    context = mp.get_context("fork")
    for stream in (sys.stdout, sys.stderr):  # else the child would write their buffers too
        stream.flush()
    answer, sender = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(sender, run, args), daemon=True)
    child.start()
    sender.close()

    def result() -> T:
        try:
            ok, value = answer.recv()
        except EOFError:
            child.join()
            raise RuntimeError(f"the child process died (exit code "
                               f"{child.exitcode})") from None
        if not ok:
            raise value
        return value
    try:
        yield result
    finally:  # answered, or this process failed first: then the child is not needed
        answer.close()
        if child.is_alive():
            child.terminate()
        child.join()


def _answer(sender, run: Callable, args: tuple) -> None:
    try:
        sender.send((True, run(*args)))
    except BaseException as error:  # handed to the parent, raised there
        sender.send((False, error))
    finally:
        sender.close()


def in_two_halves(rows: Callable[[range], str], n: int) -> str:
    """``rows(range(n))`` as ``rows(range(0, h)) + rows(range(h, n))``, the second half
    in a forked child (``h = n // 2``). ``rows`` must be a pure function of its range whose
    texts concatenate; an exception from either half is raised here, the first half's first."""
    if n < 2 or not can_fork():
        return rows(range(n))
    with forked(rows, range(n // 2, n)) as second:
        first = rows(range(n // 2))
        return first + second()
