"""``mpipe-run``: start one process per rank on this machine.

    mpipe-run --nproc N [--backend gloo|nccl] [--timeout S] [--verbose] [--log-dir DIR]
              script.py [args...]
    mpipe-run --nproc N [...] -m module [args...]

Each process runs ``script.py args...`` as ``python script.py args...`` would
(``python -m module args...`` with ``-m``), through the bootstrap ``executor.rank_main``,
with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port) set, so the script initialises
with ``init_distributed()`` (env init), exactly as under ``torchrun``. The backend is gloo
on CPU, NCCL when every rank has its own GPU (``--backend`` or ``MPIPE_BACKEND``
overrides); ``OMP_NUM_THREADS`` defaults to the cores divided among the ranks. When a rank
exits with an error, the others are stopped at once and ``mpipe-run`` exits with that
rank's code (128 + signal for a rank killed by a signal); it exits 0 only if every rank
does. Multi-node runs are ``torchrun``'s job (see docs/executor.md).

Output: each rank's stdout and stderr are forwarded to ``mpipe-run``'s own, line by line,
every line prefixed with its rank as torchrun does (``[rank1]:step 3 loss 0.52``), so the
ranks' lines never interleave mid-line, on a terminal, in a file or through a pipe.

Failures: a rank whose script raises an exception it does not catch prints one line,
``[rank1]:rank 1: PipelineError: ... (full traceback: DIR/rank1.log)``, and exits 1; its
full traceback (chained causes included) is in ``DIR/rank1.log``. ``DIR`` is ``--log-dir``
or a fresh temporary directory (``mpipe-run-logs-*``), which is removed when every rank
succeeds and kept when one fails; the launcher's line about the failure names it
(``mpipe-run: rank 1 exited with code 1; stopping the other ranks (tracebacks in DIR)``).
``--verbose`` prints each failing rank's full traceback instead of its one line (the log
files are still written). ``SystemExit`` (``sys.exit(2)``) and ``KeyboardInterrupt`` end a
rank as they would under plain Python.
"""

from __future__ import annotations

import argparse
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from .rank_main import LOG_ENV, VERBOSE_ENV

BOOTSTRAP = "mpipe_verified.executor.rank_main"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None,
             backend: str | None = None, timeout: float | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    if "OMP_NUM_THREADS" not in env:  # like torchrun: do not oversubscribe the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if backend:
        env["MPIPE_BACKEND"] = backend
    if timeout is not None:
        env["MPIPE_TIMEOUT"] = str(timeout)
    return env


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _pump(pipe: IO[bytes], out: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``out`` a whole line at a time, each line after ``prefix`` (a last
    line without its newline gets one; a line that already starts with it, as torch's
    own exception hook writes a rank's traceback, ``[rank1]: Traceback``, gets it once)."""
    with pipe:
        for line in iter(pipe.readline, b""):
            with lock:
                out.write((line if line.startswith(prefix) else prefix + line)
                          + (b"" if line.endswith(b"\n") else b"\n"))
                out.flush()


def _forward_output(procs: list[subprocess.Popen]) -> list[threading.Thread]:
    """One ``_pump`` thread per rank and stream, all writing under one lock."""
    lock = threading.Lock()
    threads = [threading.Thread(target=_pump, args=(pipe, out, f"[rank{r}]:".encode(), lock),
                                daemon=True)
               for r, p in enumerate(procs)
               for pipe, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer))]
    for t in threads:
        t.start()
    return threads


def rank_command(script: str, args: list[str], module: bool = False) -> list[str]:
    """The argv that runs ``script`` (a module with ``module``) on one rank, through the
    bootstrap ``executor.rank_main``."""
    return [sys.executable, "-m", BOOTSTRAP, "-m" if module else "--", script, *args]


def rank_log(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def launch(nproc: int, command: list[str], backend: str | None = None,
           timeout: float | None = None, env: dict | None = None, quiet: bool = False,
           log_dir: str | None = None, verbose: bool = False) -> int:
    """Run ``command`` (argv) as ``nproc`` ranks; returns the exit code described in the
    module docstring. With ``log_dir``, rank ``r``'s bootstrap (``rank_command``) writes an
    uncaught exception's traceback to ``log_dir/rank{r}.log``; ``verbose`` has it print
    the traceback rather than one line."""
    if nproc < 1:
        raise ValueError("--nproc must be >= 1")
    port = free_port()
    envs = [rank_env(r, nproc, port, env, backend, timeout) for r in range(nproc)]
    for r, e in enumerate(envs):
        e.pop(LOG_ENV, None)  # not an outer mpipe-run's
        if log_dir is not None:
            e[LOG_ENV] = rank_log(log_dir, r)
            if os.path.exists(e[LOG_ENV]):  # an earlier run's
                os.remove(e[LOG_ENV])
        e[VERBOSE_ENV] = "1" if verbose else "0"
    procs = [subprocess.Popen(command, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for e in envs]
    pumps = _forward_output(procs)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if not quiet:
                    where = (f" (tracebacks in {log_dir})"
                             if log_dir is not None and _has_logs(log_dir, nproc) else "")
                    for t in pumps[2 * rank:2 * rank + 2]:  # the rank's last lines first
                        t.join(timeout=1.0)
                    sys.stderr.write(f"mpipe-run: rank {rank} exited with code {_code(code)}; "
                                     f"stopping the other ranks{where}\n")
                    sys.stderr.flush()
                _stop(procs)
                return _code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _stop(procs)
        for t in pumps:  # the ranks are gone: their last lines are on the way
            t.join(timeout=5.0)


def _has_logs(log_dir: str, nproc: int) -> bool:
    return any(os.path.exists(rank_log(log_dir, r)) for r in range(nproc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mpipe-run", description="Run a script as N ranks of a torch.distributed job "
        "on this machine (env init, like torchrun).")
    ap.add_argument("--nproc", "--nproc-per-node", type=int, required=True,
                    help="number of ranks (processes)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                    help="process-group backend (default: NCCL if every rank has a GPU, "
                         "else gloo)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a communication op may wait before the ranks give up "
                         "(MPIPE_TIMEOUT; default 300; start-up has its own, "
                         "MPIPE_STARTUP_TIMEOUT, default 1800)")
    ap.add_argument("--verbose", action="store_true",
                    help="a rank that fails prints its full traceback (default: one line "
                         "naming the exception and its log file)")
    ap.add_argument("--log-dir", metavar="DIR", default=None,
                    help="where each failing rank writes its full traceback, rankN.log "
                         "(default: a temporary directory, removed if every rank succeeds)")
    ap.add_argument("-m", "--module", action="store_true",
                    help="SCRIPT names a module: run python -m SCRIPT (as torchrun -m)")
    ap.add_argument("script", metavar="SCRIPT", help="Python script (or, with -m, module) "
                                                     "to run on every rank")
    rest = ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False  # so that a missing SCRIPT is reported alone
    ns = ap.parse_args(argv)
    if ns.nproc < 1:
        ap.error("--nproc must be >= 1")
    if not ns.module and not os.path.exists(ns.script):
        ap.error(f"no such script: {ns.script}")
    if ns.log_dir is not None:
        log_dir, temporary = ns.log_dir, False
        os.makedirs(log_dir, exist_ok=True)
    else:
        log_dir, temporary = tempfile.mkdtemp(prefix="mpipe-run-logs-"), True
    code = 1
    try:
        code = launch(ns.nproc, rank_command(ns.script, ns.args, ns.module), ns.backend,
                      ns.timeout, log_dir=log_dir, verbose=ns.verbose)
        return code
    finally:
        if temporary and (code == 0 or not os.listdir(log_dir)):
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
