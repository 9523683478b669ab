"""``mpipe-run``'s failure output (plain-Python scripts, no torch): a rank that raises prints
one line naming the exception and its log file, the log holds the full traceback,
``--verbose`` prints the traceback instead; scripts and modules run through the per-rank
bootstrap (``executor.rank_main``) exactly as under plain ``python``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
MPIPE_RUN = os.path.join(os.path.dirname(sys.executable), "mpipe-run")

CHAINED = """
    import os, sys, time
    print("rank", os.environ["RANK"], "starts", flush=True)
    open("started." + os.environ["RANK"], "w").close()
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 60  # rank 0 has printed before rank 1 fails
        while not os.path.exists("started.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            {{}}["missing"]
        except KeyError as err:
            raise RuntimeError("rank 1 gave up\\nsecond line of the message") from err
"""


def write(path, body: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def run(args, cwd, tmpdir=None, timeout=60, **env):
    """``mpipe-run args`` in ``cwd``, with TMPDIR ``tmpdir`` (where its default log
    directory goes)."""
    environ = dict(os.environ, **env)
    if tmpdir is not None:
        tmpdir.mkdir(exist_ok=True)
        environ["TMPDIR"] = str(tmpdir)
    return subprocess.run([MPIPE_RUN, *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def test_a_failing_rank_prints_one_line_and_its_log_holds_the_traceback(tmp_path):
    write(tmp_path / "script.py", CHAINED.replace("{{}}", "{}"))
    logs = tmp_path / "logs"
    done = run(["--nproc", "2", "--log-dir", str(logs), "script.py"], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    log = logs / "rank1.log"
    assert done.stderr.splitlines() == [
        f"[rank1]:rank 1: RuntimeError: rank 1 gave up ... (full traceback: {log})",
        f"mpipe-run: rank 1 exited with code 1; stopping the other ranks (tracebacks in "
        f"{logs})"], done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]:rank 0 starts",
                                                "[rank1]:rank 1 starts"]
    assert "Traceback" not in done.stdout + done.stderr
    assert os.listdir(logs) == ["rank1.log"]
    text = log.read_text()
    assert text.startswith("Traceback (most recent call last):\n")
    assert "KeyError: 'missing'" in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert text.endswith("RuntimeError: rank 1 gave up\nsecond line of the message\n")
    assert f'File "{tmp_path / "script.py"}", line 10, in <module>' in text
    assert "rank_main" not in text and "runpy" not in text  # the script's frames only


def test_a_pipeline_error_from_another_is_one_line(tmp_path):
    write(tmp_path / "script.py", """
        import os
        from mpipe_verified.executor import PipelineError
        if os.environ["RANK"] == "0":
            try:
                raise ConnectionError("Connection reset by peer")
            except ConnectionError as err:
                raise PipelineError("rank 0: 0RECV_F1 at position 3 from rank 1 failed: "
                                    "peer closed") from err
    """)
    done = run(["--nproc", "2", "script.py"], tmp_path, tmpdir=tmp_path / "tmp")
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("[rank")]
    found = re.fullmatch(r"\[rank0\]:rank 0: PipelineError: rank 0: 0RECV_F1 at position 3 "
                         r"from rank 1 failed: peer closed \(full traceback: (.*)\)", line)
    assert found, line
    log = found.group(1)
    (logs,) = (tmp_path / "tmp").iterdir()  # the default: a temporary directory, kept
    assert logs.name.startswith("mpipe-run-logs-") and log == str(logs / "rank0.log")
    assert done.stderr.splitlines()[-1] == (
        f"mpipe-run: rank 0 exited with code 1; stopping the other ranks (tracebacks in "
        f"{logs})")
    assert "Traceback" not in done.stderr
    text = open(log).read()
    assert "ConnectionError: Connection reset by peer" in text
    assert "mpipe_verified.executor.errors.PipelineError: rank 0: 0RECV_F1" in text


def test_verbose_prints_the_full_traceback(tmp_path):
    write(tmp_path / "script.py", CHAINED.replace("{{}}", "{}"))
    done = run(["--nproc", "2", "--verbose", "script.py"], tmp_path, tmpdir=tmp_path / "tmp")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [x[len("[rank1]:"):] for x in done.stderr.splitlines()
             if x.startswith("[rank1]:")]
    assert lines[0] == "Traceback (most recent call last):", lines
    assert "KeyError: 'missing'" in lines
    assert "The above exception was the direct cause of the following exception:" in lines
    assert lines[-2:] == ["RuntimeError: rank 1 gave up", "second line of the message"]
    assert not any("full traceback" in x for x in lines)
    assert "rank_main" not in done.stderr and "runpy" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "mpipe-run: rank 1 exited with code 1; stopping the other ranks")


def test_a_successful_run_prints_the_output_unchanged_and_leaves_no_logs(tmp_path):
    write(tmp_path / "script.py", """
        import os, sys
        r = os.environ["RANK"]
        print(f"out {r} a")
        print(f"err {r}", file=sys.stderr)
        print(f"out {r} b")
    """)
    done = run(["--nproc", "2", "script.py"], tmp_path, tmpdir=tmp_path / "tmp")
    assert done.returncode == 0, done.stderr
    for r in range(2):
        assert [x for x in done.stdout.splitlines() if x.startswith(f"[rank{r}]:")] == [
            f"[rank{r}]:out {r} a", f"[rank{r}]:out {r} b"]
    assert sorted(done.stderr.splitlines()) == ["[rank0]:err 0", "[rank1]:err 1"]
    assert os.listdir(tmp_path / "tmp") == []  # the temporary log directory is gone


def test_system_exit_ends_a_rank_as_under_python(tmp_path):
    write(tmp_path / "script.py", """
        import os, sys
        if os.environ["RANK"] == "1":
            sys.exit("bad arguments")
    """)
    done = run(["--nproc", "2", "script.py"], tmp_path, tmpdir=tmp_path / "tmp")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "[rank1]:bad arguments",
        "mpipe-run: rank 1 exited with code 1; stopping the other ranks"]
    assert os.listdir(tmp_path / "tmp") == []  # nothing logged: no directory kept


PROBE = """
    import json, os, sys
    import helper  # a module next to the script
    out = dict(argv=sys.argv, name=__name__, path0=sys.path[0], file=__file__,
               package=__package__, spec=repr(__spec__), helper=helper.VALUE,
               main=sys.modules["__main__"].__dict__ is globals(),
               cwd_on_path=os.getcwd() in sys.path,
               heavy=sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "z3")))
    with open(os.path.join(os.environ["OUT"], "probe." + os.environ.get("RANK", "plain")),
              "w") as f:
        json.dump(out, f)
"""


def test_a_script_runs_as_under_plain_python(tmp_path):
    """sys.argv (arguments that look like mpipe-run's own included), __name__, __file__,
    sys.path[0] (the script's directory: a module next to it imports) and __main__ are
    what ``python sub/probe.py ...`` gives; the bootstrap imports neither torch nor z3."""
    write(tmp_path / "sub" / "probe.py", PROBE)
    write(tmp_path / "sub" / "helper.py", "VALUE = 42\n")
    args = ["sub/probe.py", "a", "--verbose", "--nproc", "7", "-m"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, env=dict(env, OUT=str(tmp_path)),
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    expected = json.loads((tmp_path / "probe.plain").read_text())
    assert expected["argv"] == args and expected["name"] == "__main__"
    assert expected["path0"] == os.path.realpath(tmp_path / "sub")
    assert expected["helper"] == 42 and expected["main"] and not expected["cwd_on_path"]
    assert expected["heavy"] == []
    done = subprocess.run([MPIPE_RUN, "--nproc", "2", *args], cwd=tmp_path,
                          env=dict(env, OUT=str(tmp_path)), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for r in range(2):
        got = json.loads((tmp_path / f"probe.{r}").read_text())
        assert got == expected, (got, expected)


def test_a_module_runs_as_under_python_dash_m_and_fails_in_one_line(tmp_path):
    write(tmp_path / "rankmod.py", """
        import json, os, sys, time
        with open("mod." + os.environ["RANK"] + ".tmp", "w") as f:
            json.dump(dict(argv=sys.argv, name=__name__, path0=sys.path[0]), f)
        os.replace("mod." + os.environ["RANK"] + ".tmp", "mod." + os.environ["RANK"])
        if os.environ["RANK"] == "1":
            deadline = time.monotonic() + 60  # rank 0 has written its file first
            while not os.path.exists("mod.0") and time.monotonic() < deadline:
                time.sleep(0.01)
            raise ValueError("bad value")
    """)
    logs = tmp_path / "logs"
    done = run(["--nproc", "2", "--log-dir", str(logs), "-m", "rankmod", "x", "-y"], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    for r in range(2):
        got = json.loads((tmp_path / f"mod.{r}").read_text())
        assert got == dict(argv=[str(tmp_path / "rankmod.py"), "x", "-y"], name="__main__",
                           path0=str(tmp_path))
    assert done.stderr.splitlines()[0] == (
        f"[rank1]:rank 1: ValueError: bad value (full traceback: {logs / 'rank1.log'})")
    text = (logs / "rank1.log").read_text()
    assert text.startswith("Traceback (most recent call last):\n")
    assert text.endswith("ValueError: bad value\n") and "rank_main" not in text


def test_a_missing_script_is_named_alone():
    done = subprocess.run([MPIPE_RUN, "--nproc", "2"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "mpipe-run: error: the following arguments are required: SCRIPT")


def test_a_line_that_already_names_its_rank_gets_the_prefix_once(tmp_path):
    """torch's exception hook prefixes a rank's traceback lines with ``[rankN]: ``;
    ``mpipe-run`` does not add a second ``[rankN]:``."""
    write(tmp_path / "script.py", """
        import os
        r = os.environ["RANK"]
        print(f"[rank{r}]: Traceback (as torch writes it)")
        print(f"plain {r}")
    """)
    done = run(["--nproc", "2", "script.py"], tmp_path, tmpdir=tmp_path / "tmp")
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["[rank0]: Traceback (as torch writes it)", "[rank0]:plain 0",
                     "[rank1]: Traceback (as torch writes it)", "[rank1]:plain 1"], lines
