"""JUnit XML of ``mpipe-verify check``: one test suite per input, one test case per property.

A proven property passes; a violated one fails (``<failure>`` with each counterexample);
an undecided one is an ``<error>`` (Z3 answered unknown); an input that could not be read
is a suite with a single ``load`` case in error. CI systems that read JUnit (GitLab,
Jenkins, Buildkite, GitHub test reporters) then list the five properties per schedule.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ..verify import PROPERTIES
from .sarif import Checked


def junit_xml(checked: list[Checked]) -> str:
    """The JUnit XML text of the checked inputs."""
    root = ET.Element("testsuites", name="mpipe-verify")
    totals = {"tests": 0, "failures": 0, "errors": 0}
    for item in checked:
        suite = ET.SubElement(root, "testsuite", name=item.name)
        counts = {"tests": 0, "failures": 0, "errors": 0}
        if item.report is None:
            case = ET.SubElement(suite, "testcase", classname=item.name, name="load")
            ET.SubElement(case, "error", message=item.error or "bad input").text = item.error
            counts["tests"], counts["errors"] = 1, 1
        else:
            props = item.report.stats.get("properties", {})
            for name in PROPERTIES:
                info = props.get(name, {})
                seconds = info.get("linear_seconds", 0.0) + info.get("kernel_seconds", 0.0)
                case = ET.SubElement(suite, "testcase", classname=item.name, name=name,
                                     time=f"{seconds:.4f}")
                counts["tests"] += 1
                found = [v for v in item.report.violations if v.property == name]
                if found:
                    counts["failures"] += 1
                    text = "\n\n".join("\n".join([v.message, *v.trace]) for v in found)
                    ET.SubElement(case, "failure", message=found[0].message,
                                  type=name).text = text
                elif info.get("status") == "unknown":
                    counts["errors"] += 1
                    reason = info.get("reason", "solver returned unknown")
                    ET.SubElement(case, "error", message=f"undecided: {reason}",
                                  type="undecided").text = reason
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
    for key, value in totals.items():
        root.set(key, str(value))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, "unicode") + "\n"
