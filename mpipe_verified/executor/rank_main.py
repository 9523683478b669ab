"""The per-rank bootstrap of ``mpipe-run``: run one rank's script, and turn an uncaught
exception into one line.

    python -m mpipe_verified.executor.rank_main SCRIPT [args...]
    python -m mpipe_verified.executor.rank_main -m MODULE [args...]

``SCRIPT`` runs as ``python SCRIPT args...`` would run it: as ``__main__``, with
``sys.argv == [SCRIPT, *args]``, ``__file__`` its absolute path and ``sys.path[0]`` its
directory (symbolic links resolved); a directory or zip file with a ``__main__.py`` goes
through ``runpy.run_path``. ``-m MODULE`` runs ``runpy.run_module(MODULE,
run_name="__main__", alter_sys=True)`` with ``sys.path[0]`` the current directory, as
``python -m MODULE`` does.

When the script raises an exception it does not catch (``SystemExit`` and
``KeyboardInterrupt`` excepted: they end the process as they would under plain Python), the
full traceback, as Python prints it, goes to the file named by ``MPIPE_RUN_LOG`` and stderr
gets one line:

    rank 1: PipelineError: rank 1: 1RECV_F0 at position 2 ... (full traceback: /tmp/.../rank1.log)

and the process exits 1. With ``MPIPE_RUN_VERBOSE=1`` (``mpipe-run --verbose``), or when
``MPIPE_RUN_LOG`` is not set or cannot be written, stderr gets the full traceback instead
(through ``sys.excepthook``, as Python would print it). The frames of this bootstrap are
left out of every traceback, so it starts at the script's ``<module>``.

This module imports nothing heavy (no torch, no Z3): it runs before the script does.
"""

import os
import sys

LOG_ENV = "MPIPE_RUN_LOG"
VERBOSE_ENV = "MPIPE_RUN_VERBOSE"

USAGE = "usage: python -m mpipe_verified.executor.rank_main [-m] SCRIPT|MODULE [args...]"


def _run_script(path: str, args: list[str]) -> None:
    """``python path args...``."""
    sys.argv = [path, *args]
    if os.path.isdir(path) or (not path.endswith(".py") and _is_zip(path)):
        import runpy  # a directory or zip file with a __main__.py
        del sys.path[0]  # run_path puts the path itself first, as python does
        runpy.run_path(path, run_name="__main__")
        return
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    if path.endswith(".pyc"):
        import runpy
        runpy.run_path(path, run_name="__main__")
        return
    # A source file, run as python runs it: __file__ absolute but sys.argv[0] as given
    # (run_path would give both the same), and the script's module stays __main__.
    import builtins
    import importlib.machinery
    filename = os.path.abspath(path)
    main = type(sys)("__main__")
    main.__dict__.update(__file__=filename, __cached__=None, __package__=None, __spec__=None,
                         __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", filename))
    with open(filename, "rb") as f:  # bytes: compile() honours a coding declaration
        source = f.read()
    code = compile(source, filename, "exec", dont_inherit=True)
    sys.modules["__main__"] = main  # for pickle, multiprocessing, inspect: as under python
    exec(code, main.__dict__)


def _is_zip(path: str) -> bool:
    import zipfile
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _run_module(name: str, args: list[str]) -> None:
    """``python -m name args...``."""
    import runpy
    sys.argv = [name, *args]  # run_module replaces argv[0] with the module's file
    sys.path[0] = os.getcwd()
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def _script_traceback(tb):
    """``tb`` without its leading frames of this bootstrap and of runpy."""
    import runpy
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def _first_line(err: BaseException) -> str:
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error
        return "<exception str() failed>"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] + (" ..." if len(lines) > 1 else "")


def summary(err: BaseException, rank: str | None, log: str | None) -> str:
    """The one line for ``err``: ``rank R: Type: first line (full traceback: LOG)``."""
    head = type(err).__qualname__
    first = _first_line(err)
    line = f"{head}: {first}" if first else head
    if rank is not None:
        line = f"rank {rank}: {line}"
    return line + (f" (full traceback: {log})" if log else "")


def report(err: BaseException, env=None) -> None:
    """Write ``err``'s traceback to the rank's log and one line (or, verbose, the whole
    traceback) to stderr."""
    env = os.environ if env is None else env
    tb = _script_traceback(err.__traceback__)
    err.__traceback__ = tb
    log = env.get(LOG_ENV) or None
    if log:
        import traceback
        try:
            os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
            with open(log, "w") as f:
                f.write("".join(traceback.format_exception(type(err), err, tb)))
        except OSError as e:
            print(f"rank_main: cannot write {log}: {e}", file=sys.stderr)
            log = None
    if log and env.get(VERBOSE_ENV, "0") != "1":
        print(summary(err, env.get("RANK"), log), file=sys.stderr)
    else:
        sys.excepthook(type(err), err, tb)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    module = bool(argv) and argv[0] in ("-m", "--module")
    if module or argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    try:
        (_run_module if module else _run_script)(target, args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:  # noqa: BLE001 - whatever the script raised
        report(err)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if code == 1:  # reported: leave at once, before torch's and gloo's threads tear down
        sys.stdout.flush()  # (a pending collective's thread aborts an orderly exit)
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
