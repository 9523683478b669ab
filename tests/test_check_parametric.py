"""``check --family`` answered by the family's proven laws (``check.parametric``): the
answer agrees with the op-by-op check, does not grow with the instance, compares the
memory limit with the proven peak, and its certificate certifies only the plan its
parameters derive. (A small instance is checked op by op unless ``--laws`` is given:
these tests give it; ``test_check_law_cache.py`` tests the road ``check`` picks.)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import attrs
import pytest

from mpipe_verified.algebra.families import family
from mpipe_verified.cli import main
from mpipe_verified.lower import lower
from mpipe_verified.proofs import registry
from mpipe_verified.check import parametric
from mpipe_verified.check.parametric import check_certificate
from mpipe_verified.verify import CertificateError
from test_cli_check import check_json as check, family_argv

SCRIPT = pathlib.Path(sys.executable).with_name("mpipe-verify")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test with an empty law-proof cache of its own (``XDG_CACHE_HOME``, which the
    console-script runs inherit): the laws are proven in the test, never taken from a
    proof an earlier run left."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Derived(Exception):
    """A refused claim's plan was built, derived or lowered (see ``derivations``)."""


def derivations(monkeypatch, build: bool = False) -> list[str]:
    """From now on, what the parametric check builds (``term``: the family's term at the
    claim's parameters), derives (``derive``) or lowers (``lower``), in order; a
    derivation or a lowering, and without ``build`` the term's building too, raises
    ``Derived`` instead (at a forged size it would take seconds to minutes, or all the
    memory), so a refusal must come before them. What a refusal costs is then counted,
    not timed."""
    calls: list[str] = []
    real_term = parametric._term

    class Spy:
        def __init__(self, term) -> None:
            self.term = term

        def derive(self):
            calls.append("derive")
            raise Derived(f"{self.term} derived")

    def term(claim):
        calls.append("term")
        if not build:
            raise Derived("the term built")
        return Spy(real_term(claim))

    def lowered(*args, **kwargs):
        calls.append("lower")
        raise Derived("lowered")

    monkeypatch.setattr(parametric, "_term", term)
    monkeypatch.setattr("mpipe_verified.lower.lower", lowered)
    return calls


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, None), ("1f1b", 5, 3, None),
                                           ("gpipe", 3, 4, None),
                                           ("interleaved-1f1b", 4, 6, 3),
                                           ("zbv", 3, 7, None), ("zbv", 4, 3, None),
                                           ("dualpipev", 3, 7, None),
                                           ("zb-h1", 4, 6, None), ("zb-h2", 3, 5, None),
                                           ("looped-bfs", 4, 6, 3), ("looped-bfs", 5, 2, 2),
                                           ("looped-bfs", 3, 4, 1),
                                           ("interleaved-zb", 4, 6, 2),
                                           ("interleaved-zb", 4, 3, 3),
                                           ("interleaved-zb", 3, 10, 2)])
def test_the_laws_answer_as_the_op_by_op_check_does(capsys, name, p, m, v):
    code, proof = check(capsys, *family_argv(name, p, m, v), "--laws")
    expanded_code, expanded = check(capsys, *family_argv(name, p, m, v), "--expand")
    assert code == expanded_code == 0
    assert proof["proof"]["kind"] == "parametric" and expanded["proof"] == {"kind": "instance"}
    laws = {registry.BY_NAME[n].property: n for n in proof["proof"]["laws"]}
    assert set(laws) == {"completeness", "dependency", "matching", "deadlock", "memory"}
    assert all(registry.BY_NAME[n].family == name for n in laws.values())
    assert {k: info["law"] for k, info in proof["stats"]["properties"].items()} == laws
    assert proof["peak_memory"] == expanded["peak_memory"]  # the formula = the verifier's


def test_time_does_not_grow_with_the_instance():
    """100,000 ranks and 10^7 microbatches: ~10^12 ops, which no op-by-op check could
    lower within the timeout; the laws answer."""
    proc = subprocess.run([str(SCRIPT), "check", *family_argv("1f1b", 100_000, 10_000_000),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verified"] and doc["proof"]["kind"] == "parametric"
    assert doc["peak_memory"]["0"] == 100_000 and doc["peak_memory"]["99999"] == 1


def test_memory_limit_against_the_proven_peak(capsys):
    code, doc = check(capsys, *family_argv("1f1b", 4, 8), "--memory-limit", "4", "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    assert doc["certificate"]["memory_limit"] == [4.0] * 4
    code, doc = check(capsys, *family_argv("1f1b", 4, 8), "--memory-limit", "3", "--laws")
    assert code == 1 and doc["proof"] == {"kind": "instance"}  # the op-by-op counterexample
    assert [v["property"] for v in doc["violations"]] == ["memory"]
    assert doc["violations"][0]["ranks"] == [0]


def test_cells_without_all_sizes_laws_are_checked_op_by_op(capsys):
    # m >= p with a last round shorter than p (10 = 4 + 4 + 2 on 3 ranks): bounded only
    code, doc = check(capsys, *family_argv("interleaved-1f1b", 3, 10, 2), "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    code, doc = check(capsys, *family_argv("zb-h1", 4, 3), "--laws")  # ZB-H1 with m < p: bounded
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    code, doc = check(capsys, *family_argv("zb-h2", 4, 6), "--laws")  # ZB-H2 with m < 2p - 1
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    code, doc = check(capsys, *family_argv("1f1b", 4, 8), "--comm-model", "eager", "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}


def test_interleaved_zb_outside_its_all_sizes_cells_is_checked_op_by_op(capsys):
    # a last round shorter than p / 2 (13 = 4 + 4 + 4 + 1 on 3 ranks): bounded only
    code, doc = check(capsys, *family_argv("interleaved-zb", 3, 13, 2), "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}
    # m < p - 1: the short word's laws, all five
    code, doc = check(capsys, *family_argv("interleaved-zb", 6, 3, 2), "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"


def test_a_memory_limit_below_the_looped_bfs_peak_is_checked_op_by_op(capsys):
    code, doc = check(capsys, *family_argv("looped-bfs", 4, 8, 2), "--memory-limit", "16",
                      "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    code, doc = check(capsys, *family_argv("looped-bfs", 4, 8, 2), "--memory-limit", "15",
                      "--laws")
    assert code == 1 and doc["proof"] == {"kind": "instance"}
    assert {v["property"] for v in doc["violations"]} == {"memory"}  # on every rank
    assert sorted(r for v in doc["violations"] for r in v["ranks"]) == [0, 1, 2, 3]


# 4 rounds of 1024: rank r's warmup is g + 2 (p - 1 - r), its peak one more; ZBV holds
# both chunks' warmup, 2p, on every rank once m >= 2p; DualPipeV one more
@pytest.mark.parametrize("name, m, v, first, last", [
    ("interleaved-1f1b", 4096, 2, 1024 + 2 * 1023 + 1, 1024 + 1),
    ("zbv", 4096, None, 2048, 2048), ("dualpipev", 2048, None, 2049, 2049),
    ("looped-bfs", 4096, 2, 8192, 8192), ("interleaved-zb", 4096, 2, 2048, 2048)])
def test_1024_ranks_are_answered_by_the_family_s_laws(name, m, v, first, last):
    proc = subprocess.run([str(SCRIPT), "check", *family_argv(name, 1024, m, v), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["proof"]["kind"] == "parametric"
    assert [registry.BY_NAME[n].family for n in doc["proof"]["laws"]] == [name] * 5
    assert doc["peak_memory"]["0"] == first and doc["peak_memory"]["1023"] == last


def test_the_text_report_names_the_laws(capsys):
    assert main(["check", *family_argv("gpipe", 2, 3), "--laws", "--verbose"]) == 0
    out = capsys.readouterr().out
    for prop in ("completeness", "dependency", "matching", "deadlock", "memory"):
        law = next(x for x in registry.LAWS if x.family == "gpipe" and x.property == prop)
        assert f"  {prop:<13} proved    law {law.name} (" in out
    assert "certificate: parametric sha256 " in out


def test_a_spec_naming_a_family_is_answered_by_its_laws(capsys, tmp_path):
    spec = tmp_path / "f.toml"
    spec.write_text('[schedule]\nexpression = "one_f_one_b(4, 6)"\n')
    code, doc = check(capsys, str(spec), "--laws")
    assert code == 0 and doc["proof"]["kind"] == "parametric"
    assert doc["proof"]["params"] == {"pp": 4, "microbatches": 6, "chunks": None}
    costly = tmp_path / "c.toml"
    costly.write_text('[schedule]\nexpression = "one_f_one_b(4, 6)"\n[cost]\nF = 1\nB = 3\n')
    code, doc = check(capsys, str(costly), "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}  # costs reorder the plan


def test_declared_sizes_on_a_family_spec_are_checked_op_by_op(capsys, tmp_path):
    """Declared sizes make the checked schedule another than the spec's term: the laws of
    the term must not answer for it (a spec of 6 microbatches declared as 9 is
    incomplete)."""
    spec = tmp_path / "f.toml"
    spec.write_text('[schedule]\nexpression = "one_f_one_b(4, 6)"\n')
    code, doc = check(capsys, str(spec), "--microbatches", "9", "--laws")
    assert code == 1 and doc["proof"] == {"kind": "instance"}
    assert not doc["verified"]


def test_a_per_rank_limit_of_the_wrong_length_is_never_answered_by_the_laws():
    """A per-rank memory limit must cover every rank: two limits for four ranks would
    leave ranks 2 and 3 unchecked, so the laws do not answer (the instance check refuses
    it with its own message)."""
    params = {"pp": 4, "microbatches": 8, "chunks": None}
    assert parametric.prove("1f1b", params, (4, 4)) is None
    assert parametric.prove("1f1b", params, (4, 3, 2, 1)) is not None  # the proven peaks


def _certificate(name="1f1b", p=3, m=5):
    return parametric.prove(name, {"pp": p, "microbatches": m, "chunks": None}).certificate


def test_a_parametric_certificate_is_refused_for_a_plan_its_parameters_do_not_derive():
    cert = _certificate()
    check_certificate(lower(family("1f1b", 3, 5).derive()), cert)
    others = {"another family, same sizes": lower(family("gpipe", 3, 5).derive()),
              "other sizes": lower(family("1f1b", 3, 6).derive())}
    plan = lower(family("1f1b", 3, 5).derive())
    prog = list(plan.programs[1])
    prog[0], prog[1] = prog[1], prog[0]
    others["two ops swapped"] = attrs.evolve(plan, programs=(plan.programs[0], tuple(prog),
                                                            plan.programs[2]))
    for what, other in others.items():
        with pytest.raises(CertificateError, match="parametric certificate refused"):
            check_certificate(other, cert)
    forged = attrs.evolve(cert, parametric=attrs.evolve(cert.parametric, laws=(
        "1f1b_completeness",) * 5))
    with pytest.raises(CertificateError, match="refused"):
        check_certificate(plan, forged)  # its digest is not its claim's
    with pytest.raises(CertificateError, match="not the ones"):
        check_certificate(plan, attrs.evolve(forged, digest=forged.parametric.digest()))


def test_a_zbv_certificate_is_refused_for_dualpipev_of_the_same_sizes():
    """Same ranks, microbatches and V placement, another program: the certificate of
    ZBV's laws certifies ZBV's plan only."""
    cert = _certificate("zbv", 3, 6)
    check_certificate(lower(family("zbv", 3, 6).derive()), cert)
    other = lower(family("dualpipev", 3, 6).derive())
    assert other.placement == lower(family("zbv", 3, 6).derive()).placement
    with pytest.raises(CertificateError, match="parametric certificate refused"):
        check_certificate(other, cert)


def test_recheck_of_a_parametric_certificate(tmp_path, capsys):
    cert, good, bad = (str(tmp_path / n) for n in ("c.json", "good.json", "bad.json"))
    assert main(["check", *family_argv("1f1b", 3, 5), "--certificate-out", cert, "-q",
                 "--laws"]) == 0
    assert main(["export", *family_argv("1f1b", 3, 5), "--to", "plan-json", "-o", good]) == 0
    assert main(["export", *family_argv("gpipe", 3, 5), "--to", "plan-json", "-o", bad]) == 0
    capsys.readouterr()
    assert main(["recheck", good, cert]) == 0
    assert "PROVEN" in capsys.readouterr().out
    assert main(["recheck", bad, cert]) == 3
    assert "not the one 1f1b derives" in capsys.readouterr().out


def test_a_parametric_certificate_is_rechecked_by_the_kernel_not_the_laws(
        tmp_path, capsys, monkeypatch):
    """Recheck turns the certificate into a witness certificate of the plan it names and
    has ``kernel.recheck`` decide: it passes with the laws' provers gone, fails when the
    kernel's recheck says no, and prints what was proven (the comm model, the limit and
    the sizes); ``--memory-limit`` must be the certificate's limit, as for any other."""
    from mpipe_verified import kernel
    from mpipe_verified.check import parametric
    cert, good = str(tmp_path / "c.json"), str(tmp_path / "good.json")
    assert main(["check", *family_argv("zb-h1", 3, 5), "--memory-limit", "9",
                 "--certificate-out", cert, "-q", "--laws"]) == 0
    assert main(["export", *family_argv("zb-h1", 3, 5), "--to", "plan-json", "-o", good]) == 0
    capsys.readouterr()

    def no_laws(*_):
        raise AssertionError("recheck asked the laws")
    monkeypatch.setattr(parametric, "prove_laws", no_laws)
    assert main(["recheck", good, cert, "--memory-limit", "9"]) == 0
    out = capsys.readouterr().out
    assert ("PROVEN (all five properties, by the kernel): under the rendezvous model, memory "
            "limit per rank 9, 9, 9, memory sizes: unit model") in out
    assert main(["recheck", good, cert, "--memory-limit", "72"]) == 3
    capsys.readouterr()
    real = kernel.recheck
    monkeypatch.setattr(kernel, "recheck", lambda *a, **k: (False, ["planted refusal"]))
    assert main(["recheck", good, cert]) == 3
    assert "planted refusal" in capsys.readouterr().out
    monkeypatch.setattr(kernel, "recheck", real)
    data = json.loads(open(cert).read())
    eager = tmp_path / "eager.json"
    eager.write_text(json.dumps({**data, "comm_model": "eager"}))
    assert main(["recheck", good, str(eager)]) == 0
    assert "under the eager model" in capsys.readouterr().out


@pytest.mark.parametrize("edit", [{"comm_model": "bogus"}, {"comm_model": None},
                                  {"memory_limit": ["nan", "nan", "nan"]},
                                  {"memory_limit": ["inf"] * 3}, {"memory_limit": "99"},
                                  {"memory_limit": [10 ** 400, 1, 1]}, {"memory_limit": [9, 9]},
                                  {"memory_limit": [True, 9, 9]}])
def test_a_malformed_parametric_certificate_is_not_established(tmp_path, capsys, edit):
    """Refused before any plan is derived or verified."""
    cert, good = tmp_path / "c.json", str(tmp_path / "good.json")
    assert main(["check", *family_argv("1f1b", 3, 5), "--certificate-out", str(cert),
                 "-q", "--laws"]) == 0
    assert main(["export", *family_argv("1f1b", 3, 5), "--to", "plan-json", "-o", good]) == 0
    cert.write_text(json.dumps({**json.loads(cert.read_text()), **edit}))
    capsys.readouterr()
    assert main(["recheck", good, str(cert), "--json"]) == 3
    assert "malformed parametric certificate" in json.loads(capsys.readouterr().out)[
        "reasons"][0]


def _said(proved: str = "true", count: int = 59, package: str | None = None) -> str:
    import mpipe_verified
    package = package or os.path.abspath(mpipe_verified.__file__)
    text = json.dumps({"proved": proved == "true", "obligations": count, "package": package})
    return "echo '" + text + "'"


@pytest.mark.parametrize("answers", [
    ("exit 1", "exit 1"),                                  # a prover that fails
    (_said(), "echo nonsense"),
    (_said(), _said(count=58)),  # the parts disagree on the obligations they split
    (_said(), _said("false")),
    (_said(), _said() + "; exit 1"),                      # it said so, then failed
    (_said(), _said(package="/elsewhere/mpipe_verified/__init__.py")),  # another copy
])
def test_a_prover_that_does_not_prove_its_part_leaves_the_check_to_the_instance(
        capsys, monkeypatch, tmp_path, answers):
    """The laws answer only when every freshly started prover exits 0 with its part proved,
    from this process's own package, and all count the same obligations; else ``check
    --family`` checks the instance op by op (and still finds it verified)."""
    first, second = answers
    fake = tmp_path / "python"  # argv: -P -m MODULE FAMILY PARAMS INDEX JOBS
    fake.write_text(f'#!/bin/sh\nif [ "$6" = 0 ]; then {first}; else {second}; fi\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    code, doc = check(capsys, *family_argv("1f1b", 4, 8), "--laws")
    assert code == 0 and doc["proof"] == {"kind": "instance"}


def test_the_provers_prove_each_distinct_obligation_once_between_them(monkeypatch):
    """Every distinct obligation is in exactly one prover's part, and a part is proved
    only when its hypotheses were shown satisfiable too. The parts' split is read here
    with Z3's answers stubbed (a proof in this long-lived process would depend on what Z3
    did before in it, which is why the provers are fresh interpreters); the proofs
    themselves come from ``prove_laws``' fresh interpreters."""
    from mpipe_verified.proofs import core, covering
    params = {"pp": 4, "microbatches": 8, "chunks": None}
    every = covering.distinct_obligations("1f1b", params)
    given: list = []

    def proved(law, detail=""):
        given.append(law.obligations())
        return law.result(core.PROVED, 0.0, detail, len(given[-1]))
    monkeypatch.setattr(covering, "check", proved)
    assert [covering.prove_part("1f1b", params, i, 3) for i in range(3)] == [
        (True, len(every))] * 3
    keys = [covering._key(ob) for part in given for ob in part]
    assert len(keys) == len(set(keys)) == len(every)  # each once: Z3 shares equal terms
    assert set(keys) == {covering._key(ob) for ob in every}
    monkeypatch.setattr(covering, "check", lambda law: proved(
        law, "hypotheses not shown satisfiable within 1000 ms: x"))
    assert covering.prove_part("1f1b", params, 0, 3)[0] is False
    monkeypatch.undo()
    proved_now, count = parametric.prove_laws("1f1b", params, jobs=3)
    assert proved_now and count == len(every) > 0


def test_the_derivation_spy_sees_an_honest_claim_derived(tmp_path, capsys, monkeypatch):
    """The control of the tests below: an honest claim's check does build, then derive,
    its plan, so a refusal with no call recorded came before the derivation."""
    from mpipe_verified.verify.report import Certificate
    cert, plan = tmp_path / "c.json", tmp_path / "i.json"
    argv = family_argv("interleaved-1f1b", 2, 4)
    assert main(["check", *argv, "--certificate-out", str(cert), "-q", "--laws"]) == 0
    assert main(["export", *argv, "--to", "plan-json", "-o", str(plan)]) == 0
    from mpipe_verified.formats.plan_json import parse_plan_json
    claim = Certificate.from_json(json.loads(cert.read_text())).parametric
    calls = derivations(monkeypatch, build=True)
    with pytest.raises(Derived):
        parametric.mismatch(parse_plan_json(plan.read_text(), str(plan)), claim)
    assert calls == ["term", "derive"]


@pytest.mark.parametrize("params", [{"chunks": 10 ** 400}, {"chunks": 10 ** 6}, {"chunks": True},
                                    {"body": "x"}])
def test_a_parametric_claim_with_odd_parameters_is_refused_before_deriving(tmp_path, capsys,
                                                                         monkeypatch, params):
    """Claims with their digests recomputed (anyone can): parameters the family does not
    take, or chunks too many for the plan, are refused at once; a claim's chunks are
    never derived beyond the plan's size: not even their term is built."""
    import hashlib
    cert, plan = tmp_path / "c.json", str(tmp_path / "i.json")
    argv = family_argv("interleaved-1f1b", 2, 4)
    assert main(["check", *argv, "--certificate-out", str(cert), "-q", "--laws"]) == 0
    assert main(["export", *argv, "--to", "plan-json", "-o", plan]) == 0
    data = json.loads(cert.read_text())
    claim = data["parametric"]
    claim["params"].update(params)
    data["digest"] = hashlib.sha256(json.dumps(
        {"family": claim["family"], "params": claim["params"], "laws": claim["laws"]},
        sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    cert.write_text(json.dumps(data))
    capsys.readouterr()
    calls = derivations(monkeypatch)
    assert main(["recheck", plan, str(cert)]) == 3
    assert calls == []
    out = capsys.readouterr().out
    assert any(why in out for why in ("is not a number of chunks", "parameters are",
                                      "derive at least", "must be an integer, a text or null"))


def _parametric(data: dict, **params) -> dict:
    """``data``, a parametric certificate, with its claim's parameters changed and its
    digest recomputed (it is only the claim's SHA-256: anyone can)."""
    import hashlib
    claim = {**data["parametric"], "params": {**data["parametric"]["params"], **params}}
    digest = hashlib.sha256(json.dumps({k: claim[k] for k in ("family", "params", "laws")},
                                       sort_keys=True, separators=(",", ":")).encode())
    return {**data, "parametric": claim, "digest": digest.hexdigest()}


def test_a_claim_bigger_than_its_plan_is_refused_before_deriving(tmp_path, capsys,
                                                                  monkeypatch):
    """A 4-op plan whose header says 200,000 microbatches, with a 1F1B claim at those
    parameters: refused before its term is even built (deriving it took 39 s and 1.5 GB),
    and the JSON says what the refused certificate claimed."""
    cert = tmp_path / "c.json"
    assert main(["check", *family_argv("1f1b", 4, 8), "--certificate-out", str(cert),
                 "-q", "--laws"]) == 0
    plan = tmp_path / "tiny.json"
    plan.write_text(json.dumps({
        "format": "mpipe-plan-json", "version": 1, "type": "plan", "num_ranks": 4,
        "stage_to_rank": [0, 1, 2, 3], "num_microbatches": 200000, "cut": [], "programs": [
            [{"op": "compute", "kind": "F", "stage": 0, "mb": 0},
             {"op": "send", "dst": 1, "payload": {"kind": "act", "stage": 0, "mb": 0}}],
            [{"op": "recv", "src": 0, "payload": {"kind": "act", "stage": 0, "mb": 0}},
             {"op": "compute", "kind": "F", "stage": 1, "mb": 0}], [], []]}))
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({**_parametric(json.loads(cert.read_text()),
                                                microbatches=200000), "memory_limit": [3] * 4}))
    capsys.readouterr()
    calls = derivations(monkeypatch)
    assert main(["recheck", str(plan), str(forged), "--json"]) == 3
    assert calls == []
    doc = json.loads(capsys.readouterr().out)
    assert "derive at least 800000 forwards, the plan has 4 steps" in doc["reasons"][0]
    assert (doc["comm_model"], doc["memory_limit"], doc["memory_sizes"]) == (
        "rendezvous", [3] * 4, "unit model")


@pytest.mark.parametrize("properties", [[[1]], [{}], "completeness", None])
def test_a_parametric_certificate_with_odd_properties_is_not_established(tmp_path, capsys,
                                                                         properties):
    cert, good = tmp_path / "c.json", str(tmp_path / "good.json")
    assert main(["check", *family_argv("1f1b", 3, 5), "--certificate-out", str(cert),
                 "-q", "--laws"]) == 0
    assert main(["export", *family_argv("1f1b", 3, 5), "--to", "plan-json", "-o", good]) == 0
    cert.write_text(json.dumps({**json.loads(cert.read_text()), "properties": properties}))
    capsys.readouterr()
    assert main(["recheck", good, str(cert)]) == 3
    assert "malformed parametric certificate" in capsys.readouterr().out
    assert main(["recheck", good, str(cert), "--solver-rlimit", "0"]) == 2


def test_a_forged_transpose_claim_is_refused_before_its_plan_is_derived(tmp_path, capsys,
                                                                        monkeypatch):
    """Deriving transpose grows with the square of the microbatches (13 s at 2000): a
    claim whose laws are not the ones covering its parameters is refused before that
    (its term is built, cheap, never derived nor lowered), and a parameter nested a
    thousand deep is malformed, not a RecursionError."""
    m = 2000
    plan = tmp_path / "t.json"
    plan.write_text(json.dumps({
        "format": "mpipe-plan-json", "version": 1, "type": "plan", "num_ranks": 2,
        "stage_to_rank": [0, 1], "num_microbatches": m, "cut": [], "programs": [
            [{"op": "compute", "kind": "F", "stage": 0, "mb": 0}] * (4 * m)
            + [{"op": "send", "dst": 1, "payload": {"kind": "act", "stage": 0, "mb": 0}}],
            [{"op": "recv", "src": 0, "payload": {"kind": "act", "stage": 0, "mb": 0}}]]}))
    cert = tmp_path / "c.json"
    assert main(["check", *family_argv("1f1b", 2, 2), "--certificate-out", str(cert),
                 "-q", "--laws"]) == 0
    data = json.loads(cert.read_text())
    data["parametric"] = {**data["parametric"], "family": "transpose", "laws": []}
    forged = _parametric(data, microbatches=m, body="1f1b", side="source", mode="recompute",
                         ownership="cost")
    (tmp_path / "f.json").write_text(json.dumps(forged))
    nested = _parametric(data, microbatches=m, body="1f1b", side="source", mode="recompute",
                         ownership="cost")
    nested["parametric"]["params"]["chunks"] = json.loads("[" * 900 + "]" * 900)
    (tmp_path / "n.json").write_text(json.dumps(nested))
    capsys.readouterr()
    calls = derivations(monkeypatch, build=True)
    assert main(["recheck", str(plan), str(tmp_path / "f.json")]) == 3
    assert "derive" not in calls and "lower" not in calls, calls
    assert "are not the ones that prove transpose" in capsys.readouterr().out
    assert main(["recheck", str(plan), str(tmp_path / "n.json")]) == 3
    assert "derive" not in calls and "lower" not in calls, calls
    assert "each parameter must be an integer, a text or null" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["looped-bfs", "interleaved-zb"])
def test_a_chunked_family_s_size_counts_its_chunks(name):
    """The road is picked by the plan's size: v chunks on p ranks are p v stages."""
    chunked = parametric.estimated_ops(name, {"pp": 4, "microbatches": 8, "chunks": 4})
    assert chunked == parametric.estimated_ops("gpipe", {"pp": 16, "microbatches": 8,
                                                         "chunks": None})
