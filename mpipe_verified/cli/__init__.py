"""``mpipe-verify``: the command-line contract of docs/semantics.md §6.

Subcommands (each registered by one ``add_*`` function of its module: ``verdicts``
(export, check), ``views`` (show, diff, simulate), ``proving`` (laws, recheck), ``tune``,
``importing`` (import);
all share the target selection of ``targets.add_target_arguments`` and
``targets.load_target``)::

    mpipe-verify export SPEC|FILE | --family NAME --pp P --microbatches M [--chunks V | --waves W]
                        [--format auto|spec|torch-csv|plan-json]
                        --to torch-csv|chrome-trace|plan-json [--compute-only]
                        [--allow-unverified] [-o OUT]
    mpipe-verify show   SPEC|FILE | --family ... [--format ...] [--width N]
                        [--svg OUT [--arrows] [--memory]]
    mpipe-verify check  SPEC|FILE... | --family ... [--format ...]
                        [--comm-model rendezvous|eager] [--memory-limit N]
                        [--json | -q | -v] [--expand | --laws] [--no-cache]
                        [--sarif OUT] [--junit OUT] [--svg OUT [--arrows] [--memory]]
                        [--only-schedules] [--stages S] [--microbatches M] [--ranks R]
                        [--certificate-out CERT.json]
    mpipe-verify diff   OLD NEW [--format ...] [--comm-model ...] [--memory-limit N] [--json]
    mpipe-verify simulate SPEC|FILE | --family ... [--compare FAMILY ...] [--memory-limit N]
                        [--comm-model eager|rendezvous] [--json]
    mpipe-verify recheck PLAN CERT.json [--solver-rlimit R] [--json]
    mpipe-verify tune   SPEC [--budget SECONDS] [--json] [-o BEST.toml]
    mpipe-verify import FILE [--format auto|torch-csv|plan-json] [-o SPEC.toml]

``--family transpose`` takes ``--body``, ``--mode``, ``--ownership``, ``--side`` and
``--encoder-cost`` (every other target rejects them: ``targets.check_transpose_options``).

Invariants: bad input or usage exits 2 with exactly one line on stderr
(``mpipe-verify: error: ...``, naming the file and position where there is one) and
never a traceback; ``-o OUT``, ``--svg``, ``--sarif`` and ``--junit`` are written
atomically (a failure leaves no partial file) and their missing parent directories are
created. ``check`` with several files reports each (a bad one as its error line) and
exits with the worst code (``verdicts.EXIT_SEVERITY``). ``diff`` exits 1 when NEW
violates a property. ``mpipe-verify --version`` prints the package's ``__version__``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import NoReturn, Sequence

from .. import __version__
from ..errors import InputError, ParameterError
from .importing import add_import
from .proving import add_laws, add_recheck
from .targets import PROG, UsageError, fail, one_line
from .tune import add_tune
from .verdicts import add_check, add_export
from .views import add_diff, add_show, add_simulate

__all__ = ["main", "console_main", "build_parser", "UsageError"]

COMMANDS = (add_export, add_show, add_check, add_laws, add_diff, add_simulate, add_recheck,
            add_tune, add_import)  # in the order --help lists them


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``PROG: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Verified pipeline-parallel schedules.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def console_main() -> NoReturn:
    """The ``mpipe-verify`` command: ``main`` in a process of its own. Reference counting
    frees everything the command builds (plans and facts are acyclic), so the cyclic
    collector stays off: it would only rescan every op of a big plan. Once ``main`` has
    answered (its files written and closed, its child processes joined), the process
    flushes its two streams and ends without tearing down the interpreter: freeing a big
    plan's objects and their caches one by one took 0.3 s at 10^6 ops. Big arrays get
    no huge pages (``_without_huge_pages``)."""
    gc.disable()
    _without_huge_pages()
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # stdout closed early (| head)
        code = code or 141
    except (OSError, ValueError):  # a stream closed or gone: nothing left to write to
        pass
    os._exit(code)


def _without_huge_pages() -> None:
    """Ask numpy not to advise huge pages for its big arrays (what its environment
    variable ``NUMPY_MADVISE_HUGEPAGE=0`` does; a choice made there is kept). Where the
    kernel serves advised huge pages by compacting memory at the first touch (Linux's
    common ``transparent_hugepage/defrag = madvise``), each new array of tens of MB
    stalled there: at 3.1M ops, 1.3-1.5 s of the system time of ``check``."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    advise = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if advise is not None:
        advise(False)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BrokenPipeError:  # stdout closed early (| head): not an error worth a line
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except (UsageError, InputError, ParameterError) as e:
        return fail(str(e))
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        return 130
