"""Portable certificates: the JSON a verified plan's witness is written as
(``certificate``), and its reader (``read_claim``), which turns that JSON back into the claim
it makes, or refuses it, and decides nothing: the checker proves the claim
(``checker.recheck``). A certificate names its plan by ``digest``, the SHA-256 of the
plan's canonical text."""

from __future__ import annotations

import hashlib

import attrs

from ..ir import PROPERTIES, Leaf, Payload, Plan
from .columns import exact, exacts, json_number
from .inputs import Sizes, Witness

CERTIFICATE_FORMAT = "mpipe-certificate/1"


def digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical text (what a certificate is about)."""
    return hashlib.sha256(plan.canonical_text().encode()).hexdigest()


def certificate(plan: Plan, witness: Witness, comm_model: str, sizes: Sizes, limits) -> dict:
    """The portable certificate: what is claimed about which plan, and the witness."""
    return {"format": CERTIFICATE_FORMAT, "digest": digest(plan), "comm_model": comm_model,
            "properties": list(PROPERTIES),
            "memory_limit": None if limits is None else [json_number(exact(x)) for x in limits],
            "sizes": sizes_json(sizes), "witness": witness_json(witness)}


def witness_json(witness: Witness) -> dict:
    return {"finish": [list(f) for f in witness.finish],
            "producers": [list(p) for p in witness.producers],
            "levels": [[json_number(x) for x in lv] for lv in witness.levels],
            "peaks": [json_number(x) for x in witness.peaks], "peak_at": list(witness.peak_at)}


def sizes_json(sizes: Sizes) -> dict:
    return {"stored": [[seg, s, json_number(v)] for (seg, s), v in sorted(sizes.stored.items())],
            "buffer": [[_payload_json(p), json_number(v)]
                       for p, v in sorted(sizes.buffer.items(), key=repr)],
            "static": [json_number(v) for v in sizes.static]}


def _payload_json(p: Payload) -> dict:
    """A buffer's payload as JSON; ``leaves`` only for a structured payload (``[path,
    shape, dtype]`` each), so certificates of single-tensor plans read as before."""
    out = {"kind": p.kind, "stage": p.stage, "mb": p.mb, "segment": p.segment,
           "dtype": p.dtype, "shape": None if p.shape is None else list(p.shape),
           "to_segment": p.to_segment}
    if p.leaves is not None:
        out["leaves"] = [[x.path, None if x.shape is None else list(x.shape), x.dtype]
                         for x in p.leaves]
    return out


class Refused(Exception):
    """A certificate that does not make the claim asked of it; the text says why."""


@attrs.frozen
class Claim:
    """What a certificate claims: all five properties of its plan, under ``comm_model``,
    ``limits`` (one exact number per rank, or None) and ``sizes``, by ``witness``."""

    comm_model: str
    limits: tuple | None
    sizes: Sizes
    witness: Witness


def read_claim(data, about: str, comm_model: str | None = None, limits=None,
         sizes: Sizes | None = None) -> Claim:
    """The claim of a certificate's JSON ``data`` about the plan whose digest is
    ``about``. Raises ``Refused`` for a certificate of another format or plan, one that
    does not claim all five properties, or one under another comm model, limits (one
    per rank) or sizes than those given; a malformed one raises what reading it raised
    (``AttributeError``, ``KeyError``, ``TypeError``, ``ValueError`` and the like)."""
    if comm_model is not None and data.get("comm_model") != comm_model:
        raise Refused(f"the certificate is for the {data.get('comm_model')} model, not "
                      f"{comm_model}")
    if limits is not None and (type(data.get("memory_limit")) is not list or [
            exact(x) for x in data["memory_limit"]] != [exact(x) for x in limits]):
        raise Refused(f"the certificate proves the memory limit "
                      f"{data.get('memory_limit')}, not {list(limits)}")
    if data.get("format") != CERTIFICATE_FORMAT:
        raise Refused(f"not a {CERTIFICATE_FORMAT} certificate")
    if data["digest"] != about:
        raise Refused("the certificate is for another plan (digest differs)")
    if sorted(data["properties"]) != sorted(PROPERTIES):
        raise Refused("the certificate does not claim all five properties")
    limit = data["memory_limit"]
    if limit is not None and type(limit) is not list:
        raise Refused("memory_limit must be null or a list of one number per rank")
    limits = None if limit is None else tuple(exact(x) for x in limit)
    claimed, witness = read_sizes(data["sizes"]), read_witness(data["witness"])
    if sizes is not None and claimed != sizes:
        raise Refused("the certificate's memory sizes are not the ones required")
    return Claim(data["comm_model"], limits, claimed, witness)


def read_witness(data: dict) -> Witness:
    """The numbers as written (``Witness`` refuses what is not an int where one is due); a
    level or peak may also be an ``"a/b"`` text or a finite float."""
    return Witness(tuple(map(tuple, data["finish"])), tuple(map(tuple, data["producers"])),
                   tuple(map(exacts, data["levels"])), exacts(data["peaks"]),
                   tuple(data["peak_at"]))


def read_sizes(data: dict) -> Sizes:
    """The memory sizes a certificate states (``sizes_json``'s form), exact."""
    def payload(d: dict) -> Payload:
        shape, leaves = d["shape"], d.get("leaves")
        return Payload(d["kind"], d["stage"], d["mb"], d["segment"],
                       None if shape is None else tuple(shape), d["dtype"], d["to_segment"],
                       None if leaves is None else tuple(
                           Leaf(x, None if s is None else tuple(s), t) for x, s, t in leaves))
    return Sizes({(str(seg), _int(s)): exact(v) for seg, s, v in data["stored"]},
                 {payload(p): exact(v) for p, v in data["buffer"]},
                 tuple(exact(v) for v in data["static"]))


def _int(x) -> int:
    if type(x) is not int:
        raise ValueError(f"expected an integer, got {x!r}")
    return x
