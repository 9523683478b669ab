"""Portable certificates: ``check --certificate-out`` writes the witness, ``recheck`` runs
only the reader, the kernel and Z3. A certificate that does not prove its plan (another
plan's, a broken sibling's, or any perturbed one) never rechecks as proven."""

import copy
import json

import pytest

from hypothesis import given, settings, strategies as st

from mpipe_verified import kernel
from mpipe_verified.algebra import Transpose, family
from mpipe_verified.cli import main
from mpipe_verified.kernel.certificates import CERTIFICATE_FORMAT
from mpipe_verified.kernel.columns import json_number
from mpipe_verified.lower import lower
from mpipe_verified.verify import verify
import strategies as S
from plan_edits import lowered


def _certified(plan, limit=None):
    report = verify(plan, memory_limit=limit)
    assert report.verified, report.undecided
    return report.portable_certificate(plan)


def test_check_writes_a_certificate_that_recheck_proves(tmp_path, capsys):
    plan_file, cert = tmp_path / "zb.csv", tmp_path / "out" / "cert.json"
    assert main(["export", "--family", "zb-h1", "--pp", "4", "--microbatches", "8",
                 "--to", "torch-csv", "-o", str(plan_file)]) == 0
    assert main(["check", str(plan_file), "--memory-limit", "4",
                 "--certificate-out", str(cert)]) == 0
    data = json.loads(cert.read_text())
    assert data["format"] == CERTIFICATE_FORMAT and data["memory_limit"] == [4] * 4
    capsys.readouterr()
    assert main(["recheck", str(plan_file), str(cert)]) == 0
    assert "PROVEN" in capsys.readouterr().out
    other = tmp_path / "1f1b.csv"
    assert main(["export", "--family", "1f1b", "--pp", "4", "--microbatches", "8",
                 "--to", "torch-csv", "-o", str(other)]) == 0
    capsys.readouterr()
    assert main(["recheck", str(other), str(cert), "--json"]) == 3
    assert "another plan" in json.loads(capsys.readouterr().out)["reasons"][0]


def test_no_certificate_is_written_unless_verified(tmp_path, capsys):
    cert = tmp_path / "cert.json"
    assert main(["check", "examples/broken.csv", "--certificate-out", str(cert)]) == 1
    assert not cert.exists()


def test_recheck_bad_input_exits_2(tmp_path, capsys):
    plan_file = tmp_path / "p.csv"
    main(["export", "--family", "1f1b", "--pp", "2", "--microbatches", "2", "--to",
          "torch-csv", "-o", str(plan_file)])
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[]")
    capsys.readouterr()
    for args in ([str(plan_file), str(tmp_path / "missing.json")],
                 [str(plan_file), str(tmp_path / "bad.json")],
                 [str(plan_file), str(tmp_path / "list.json")],
                 ["examples/1f1b.toml", str(tmp_path / "bad.json")]):
        assert main(["recheck", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def _bases():
    yield lowered("1f1b", 4, 8), None
    yield lowered("interleaved-1f1b", 4, 8, 2), 12
    yield lower(Transpose(family("1f1b", 4, 6), mode="owner").derive()), None
    yield lower(Transpose(family("zb-h1", 2, 4), mode="recompute").derive()), 8


BASES = [(plan, limit, _certified(plan, limit)) for plan, limit in _bases()]


def _perturb(cert: dict, plan, ch) -> dict:
    """One edit that makes the certificate wrong for ``plan`` (each kind is chosen so that
    some obligation must fail: a level off by delta breaks its chain equation, a producer
    at or after its consumer breaks ``q < i``, a time below its predecessor breaks program
    order, a peak below a reached level, a limit below the peak, a digest of another plan,
    a stored size that no longer matches the levels)."""
    out = copy.deepcopy(cert)
    w = out["witness"]
    kind = ch.pick(["level", "producer", "finish", "peak", "limit", "digest", "size"])
    rank = ch.int(0, plan.num_ranks - 1)
    delta = ch.int(1, 3)
    if kind == "level":
        levels = w["levels"][rank]
        i = ch.int(0, len(levels) - 1)
        levels[i] = json_number(kernel.exact(levels[i]) + delta)
    elif kind == "producer" and w["producers"][rank]:
        w["producers"][rank][ch.int(0, len(w["producers"][rank]) - 1)] = -delta
    elif kind == "finish" and len(w["finish"][rank]) > 1:
        i = ch.int(1, len(w["finish"][rank]) - 1)
        w["finish"][rank][i] = w["finish"][rank][i - 1] - delta
    elif kind == "peak":
        w["peaks"][rank] = json_number(kernel.exact(w["peaks"][rank]) - delta)
    elif kind == "limit":
        out["memory_limit"] = [json_number(kernel.exact(p) - delta) for p in w["peaks"]]
    elif kind == "size" and out["sizes"]["stored"]:
        entry = out["sizes"]["stored"][0]  # body stage 0: stored on every forward
        entry[2] = json_number(kernel.exact(entry[2]) + delta)
    else:
        out["digest"] = "0" * 64
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(BASES))), st.data())
def test_a_perturbed_certificate_never_rechecks(base, data):
    plan, _, cert = BASES[base]
    assert kernel.recheck(plan, cert) == (True, [])
    perturbed = _perturb(cert, plan, S.DrawChooser(data.draw))
    proven, reasons = kernel.recheck(plan, perturbed)
    assert not proven and reasons


@settings(max_examples=40, deadline=None)
@given(S.mutants())
def test_a_broken_plan_never_rechecks_with_its_valid_siblings_certificate(mutant):
    """The sibling's witness, with the digest made the broken plan's own so that only the
    kernel's obligations can refuse it."""
    base, kind, _, broken, _ = mutant
    if not S.reference_verdict(broken):  # the independent judge: the edit left it valid
        return
    cert = _certified(base)
    cert["digest"] = kernel.digest(broken)
    proven, reasons = kernel.recheck(broken, cert)
    assert not proven and reasons, kind


def test_certificate_out_edges(tmp_path, capsys):
    """The certificate goes to a file, never over the input, and a failed check leaves no
    stale certificate behind."""
    plan_file = tmp_path / "p.json"
    assert main(["export", "--family", "1f1b", "--pp", "2", "--microbatches", "2",
                 "--to", "plan-json", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    for out in ["-", str(plan_file), str(tmp_path)]:
        assert main(["check", str(plan_file), "--certificate-out", out]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    cert = tmp_path / "cert.json"
    cert.write_text("stale")
    assert main(["check", "examples/broken.csv", "--certificate-out", str(cert)]) == 1
    assert not cert.exists()


def test_recheck_reads_like_check(tmp_path, capsys):
    """A plan file without an extension is sniffed as check sniffs it; a certificate that
    is not strict JSON (nested too deeply, a key twice) is bad input, one line."""
    bare = tmp_path / "plan"
    main(["export", "--family", "zb-h1", "--pp", "2", "--microbatches", "2", "--to",
          "torch-csv", "-o", str(bare)])
    cert = tmp_path / "cert.json"
    assert main(["check", str(bare), "--certificate-out", str(cert)]) == 0
    assert main(["recheck", str(bare), str(cert)]) == 0
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "twice.json").write_text('{"digest": "a", "digest": "b"}')
    capsys.readouterr()
    for bad in ("deep.json", "twice.json"):
        assert main(["recheck", str(bare), str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and bad in err and "<input>" not in err


def test_declared_sizes_are_bounded_and_only_for_files(capsys):
    for argv in (["check", "examples/broken.csv", "--stages", "100000000"],
                 ["check", "examples/broken.csv", "--ranks", "10000000"],
                 ["check", "--family", "1f1b", "--pp", "2", "--microbatches", "2",
                  "--ranks", "3"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_a_certificate_records_the_limit_the_kernel_proved_exactly():
    """A limit given exactly (4/3, met exactly by four activations of 1/3) is written to
    the certificate as that number, not through a float (which falls just below it)."""
    from fractions import Fraction
    from mpipe_verified.semantics import MemoryModel
    plan = lowered("1f1b", 4, 8)
    model = MemoryModel(stored=lambda stage, segment: Fraction(1, 3))
    report = verify(plan, memory_limit=Fraction(4, 3), memory_model=model)
    assert report.verified
    assert kernel.recheck(plan, report.portable_certificate(plan)) == (True, [])


def _zb_certified(tmp_path, *check_args: str) -> tuple:
    """ZB-H1 at pp=4, m=8 exported as plan-json, and the certificate ``check`` (with
    ``check_args``) writes for it: their two paths."""
    zb, cert = tmp_path / "zb.json", tmp_path / "zb.cert"
    assert main(["export", "--family", "zb-h1", "--pp", "4", "--microbatches", "8",
                 "--to", "plan-json", "-o", str(zb)]) == 0
    assert main(["check", str(zb), *check_args, "--certificate-out", str(cert), "-q"]) == 0
    return zb, cert


def test_a_limit_is_rechecked_under_the_memory_sizes_the_user_names(tmp_path, capsys):
    """A certificate carries its own memory sizes. With ``--memory-limit`` recheck requires
    the unit model's, or those of ``--memory-model``'s spec: a forged certificate whose
    sizes are all 0 then proves no limit, though it is proven as written."""
    spec, plan_file, cert = "examples/mllm_transpose.toml", tmp_path / "m.json", tmp_path / "m.cert"
    assert main(["check", spec, "--certificate-out", str(cert), "-q"]) == 0
    assert main(["export", spec, "--to", "plan-json", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["recheck", str(plan_file), str(cert), "--memory-limit", "72"]) == 3
    assert "memory sizes required: unit model" in capsys.readouterr().out
    assert main(["recheck", str(plan_file), str(cert), "--memory-limit", "72",
                 "--memory-model", spec]) == 0
    assert f"memory sizes: the memory model of {spec}" in capsys.readouterr().out

    (zb, zb_cert), forged = _zb_certified(tmp_path), tmp_path / "forged"
    data = json.loads(zb_cert.read_text())
    data["sizes"]["stored"] = [[seg, s, 0] for seg, s, _ in data["sizes"]["stored"]]
    data["witness"].update(levels=[[0]] * 4, peaks=[0] * 4, peak_at=[-1] * 4)
    data["memory_limit"] = [0] * 4
    forged.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["recheck", str(zb), str(forged)]) == 0
    assert "memory sizes: the certificate's own" in capsys.readouterr().out
    assert main(["recheck", str(zb), str(forged), "--memory-limit", "0"]) == 3
    assert main(["recheck", str(zb), str(zb_cert), "--memory-limit", "0"]) == 3
    capsys.readouterr()
    assert main(["recheck", str(zb), str(zb_cert), "--memory-model", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its memory model is for 8 ranks and the segments" in err


@pytest.mark.parametrize("limit", [5, "ab", {"a": 1}, [[1]] * 4, [None] * 4, [10 ** 400] * 4])
def test_a_malformed_limit_is_not_established_in_text_too(tmp_path, capsys, limit):
    """A limit that is not one exact number per rank is NOT ESTABLISHED, in text as in
    JSON; 10**400 per rank is one: proven, and said exactly."""
    zb, cert = _zb_certified(tmp_path)
    cert.write_text(json.dumps({**json.loads(cert.read_text()), "memory_limit": limit}))
    capsys.readouterr()
    if limit == [10 ** 400] * 4:
        assert main(["recheck", str(zb), str(cert)]) == 0
        assert f"memory limit per rank {10 ** 400}, " in capsys.readouterr().out
        return
    for extra in ([], ["--memory-limit", "2"], ["--comm-model", "eager"]):
        assert main(["recheck", str(zb), str(cert), *extra]) == 3
        assert "NOT ESTABLISHED" in capsys.readouterr().out


def test_recheck_states_the_proven_limit_exactly(tmp_path, capsys):
    zb, cert = _zb_certified(tmp_path, "--memory-limit", "4.123456789")
    capsys.readouterr()
    assert main(["recheck", str(zb), str(cert)]) == 0
    assert "memory limit per rank 4.123456789, 4.123456789," in capsys.readouterr().out


def test_a_memory_model_for_fewer_stages_is_bad_input(tmp_path, capsys):
    """A spec with the plan's ranks and segments whose sizes cover fewer stages."""
    plan, cert, spec = tmp_path / "i.json", tmp_path / "i.cert", tmp_path / "four.toml"
    argv = ["--family", "interleaved-1f1b", "--pp", "4", "--microbatches", "8", "--chunks", "2"]
    assert main(["export", *argv, "--to", "plan-json", "-o", str(plan)]) == 0
    assert main(["check", str(plan), "--certificate-out", str(cert), "-q"]) == 0
    spec.write_text('[schedule]\nfamily = "1f1b"\npp = 4\nmicrobatches = 8\n\n'
                    '[cost]\nactivation = [1.0, 2.0, 3.0, 4.0]\n')
    capsys.readouterr()
    assert main(["recheck", str(plan), str(cert), "--memory-model", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its memory model does not fit the plan" in err
