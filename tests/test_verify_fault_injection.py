"""The fault-injection benchmark in small (``benchmarks/fault_injection.py``): bugs
planted outside the trusted base (the shared semantics, the fast passes, and the shell
around the kernel: the lowering, the declarations, the verdict assembly) never make
``check`` accept a broken plan, because only the kernel can say VERIFIED, and only of the
plan the question is about."""

from __future__ import annotations

import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_injection as FI  # noqa: E402
from mpipe_verified import ir  # noqa: E402

# one needs rule, the eager pairing, the memory pass's level bookkeeping
SAMPLE = ("w_without_i", "recv_paired_by_payload", "memory_level_not_carried")
# the lowering drops a duplicated forward: the plan judged is no longer the input
SHELL_SAMPLE = "lower_drops_repeats"
TRUSTED = ("kernel/", "question.py", "ir.py", "formats/plan_json.py",
           "formats/torch_csv.py", "formats/torch_csv_fast.py", "formats/torch_actions.py",
           "formats/spec.py", "spec.py")
CANONICAL_TEXT = inspect.getsource(ir._canonical_row) + inspect.getsource(ir._canonical)


def test_every_fault_is_one_edit_of_the_untrusted_code():
    assert len(FI.FAULTS) >= 80 and len(FI.FAULTS_BY_NAME) == len(FI.FAULTS)
    assert len(FI.SHELL_FAULTS) >= 25 and FI.SHELL == {f.name for f in FI.SHELL_FAULTS}
    assert len({(f.path, f.old, f.new) for f in FI.FAULTS}) == len(FI.FAULTS)
    for fault in FI.FAULTS:
        if fault.name in FI.CANONICAL:  # the digest's text, which check compares nowhere
            assert fault.path == "ir.py" and CANONICAL_TEXT.count(fault.old) == 1, fault
        else:
            assert not fault.path.startswith(TRUSTED), fault
        text = (ROOT / "mpipe_verified" / fault.path).read_text(encoding="utf-8")
        assert text.count(fault.old) == 1, fault.name  # the code moved: update the fault
        assert FI.apply_fault(text, fault) != text


def test_sampled_faults_change_verdicts_but_never_verify_a_broken_plan(tmp_path):
    corpus = FI.build_corpus(str(tmp_path), small=True)
    names = [e.name for e in corpus.broken]
    assert len(names) == len(set(names)) >= 9
    pristine = FI.run_fault(None, corpus.broken + corpus.valid)
    assert {pristine[e.name][0] for e in corpus.broken} == {1}
    assert {pristine[e.name][0] for e in corpus.valid} == {0}

    faults = [FI.FAULTS_BY_NAME[n] for n in (*SAMPLE, SHELL_SAMPLE)]
    results = FI.run(faults, corpus, jobs=2, pristine=pristine)
    for result in results:
        name = result["fault"].name
        assert result["false_verified"] == [], name
        assert result["errors"] == [], name
        # the edit took effect: on some broken plan the faulty code leaves nothing for
        # the passes to find, and only the kernel (refusing their witness) or the
        # question (refusing the plan) keeps it from VERIFIED
        assert result["unaided"] and result["output"], name
        assert {result["classes"][n] for n in result["unaided"]} == {"caught_undecided"}
    shell = results[-1]
    assert shell["unaided"] == ["lowered:1f1b-p2-forward-twice"]
    lines = FI.report(results, corpus).splitlines()
    assert lines[-2] == "shell_faults=1 shell_false_verified=0"
    found = re.fullmatch(r"faults=4 false_verified=0 caught_violated=(\d+) "
                         r"caught_undecided=(\d+)", lines[-1])
    assert found, lines[-1]
    assert sum(map(int, found.groups())) == 4 * len(corpus.broken)
