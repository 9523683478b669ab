"""The fault-injection benchmark in small (``benchmarks/fault_injection.py``): bugs
planted in the untrusted layer (the shared semantics, the fast passes) never make
``check`` accept a broken plan, because only the kernel can say VERIFIED."""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_injection as FI  # noqa: E402

# one needs rule, the eager pairing, the memory pass's level bookkeeping
SAMPLE = ("w_without_i", "recv_paired_by_payload", "memory_level_not_carried")
TRUSTED = ("kernel.py", "ir.py", "cli.py", "formats/")


def test_every_fault_is_one_edit_of_the_untrusted_code():
    assert len(FI.FAULTS) >= 30 and len(FI.FAULTS_BY_NAME) == len(FI.FAULTS)
    for fault in FI.FAULTS:
        assert not fault.path.startswith(TRUSTED), fault
        text = (ROOT / "mpipe_verified" / fault.path).read_text(encoding="utf-8")
        assert text.count(fault.old) == 1, fault.name  # the code moved: update the fault
        assert FI.apply_fault(text, fault) != text


def test_sampled_faults_change_verdicts_but_never_verify_a_broken_plan(tmp_path):
    corpus = FI.build_corpus(str(tmp_path), small=True)
    names = [e.name for e in corpus.broken]
    assert len(names) == len(set(names)) >= 8
    pristine = FI.run_fault(None, corpus.broken + corpus.valid)
    assert {pristine[e.name][0] for e in corpus.broken} == {1}
    assert {pristine[e.name][0] for e in corpus.valid} == {0}

    results = FI.run([FI.FAULTS_BY_NAME[n] for n in SAMPLE], corpus, jobs=2)
    for result in results:
        name = result["fault"].name
        assert result["false_verified"] == [], name
        assert result["errors"] == [], name
        # the edit took effect: on some broken plan the faulty passes find nothing at
        # all, and only the kernel's refusal of their witness keeps it from VERIFIED
        assert result["unaided"], name
        assert {result["classes"][n] for n in result["unaided"]} == {"caught_undecided"}
    last = FI.report(results, corpus).splitlines()[-1]
    found = re.fullmatch(r"faults=3 false_verified=0 caught_violated=(\d+) "
                         r"caught_undecided=(\d+)", last)
    assert found, last
    assert sum(map(int, found.groups())) == 3 * len(corpus.broken)
