"""The counts of ONNX's node conformance suite (tests/test_onnx_node_suite.py), printed at
the end of a test run: how many cases ranvier and ONNX Runtime pass, and ranvier's
refusals grouped by reason. Each case's report carries its outcome in ranvier (passed,
xfailed with the refusal as its reason, failed) and ONNX Runtime's in its user properties,
so the counts add up the same in one process and across pytest-xdist workers."""

from __future__ import annotations

import re
from collections import Counter

SUITE_FILE = "test_onnx_node_suite.py"
ORT_PROPERTY = "onnxruntime"  # "pass" or "fail": ONNX Runtime's outcome on the same case
REFUSED = "refused: "  # how a refusal's xfail reason starts


def refusal_reason(message: str) -> str:
    """The class of a refusal: the operator missing, the element type, or the operator
    whose attribute, input or shape was refused."""
    missing = re.search(r"ONNX operator (\S+) \(domain", message)
    if missing:
        return f"operator {missing.group(1)} not supported"
    element = re.search(r"ONNX element type (\w+)", message)
    if element:
        return f"element type {element.group(1)}"
    if "is not a tensor" in message:
        return "a graph input of sequences, maps or optionals"
    if "known at load time" in message:
        return "a shape-fixing value computed in the graph"
    node = re.search(r"\((\w+), opset \d+\)", message)
    if node:
        return f"{node.group(1)}: attribute, input or shape refused"
    return message[:80]


def summarize(terminalreporter) -> None:
    outcomes: dict[str, tuple[str, str]] = {}  # case: (ranvier's outcome, ONNX Runtime's)
    refusals: Counter[str] = Counter()
    skipped = 0
    for category in ("passed", "failed", "xfailed", "skipped", "error"):
        for report in terminalreporter.stats.get(category, []):
            if SUITE_FILE not in getattr(report, "nodeid", "") or "OnnxBackendNodeModelTest" not in report.nodeid:
                continue
            if report.when != "call" and not (category in ("error", "skipped") or report.failed):
                continue
            if category == "skipped":  # the string and ai.onnx.ml cases
                skipped += 1
                continue
            ort = dict(report.user_properties).get(ORT_PROPERTY, "unknown")
            wasxfail = getattr(report, "wasxfail", "")
            if category == "xfailed" and wasxfail.startswith(REFUSED):
                outcomes[report.nodeid] = ("refused", ort)
                refusals[refusal_reason(wasxfail[len(REFUSED):])] += 1
            elif category == "passed":
                outcomes[report.nodeid] = ("passed", ort)
            else:
                outcomes[report.nodeid] = ("failed", ort)
    if not outcomes:
        return
    ranvier = Counter(mine for mine, _ in outcomes.values())
    ort_passes = [mine for mine, ort in outcomes.values() if ort == "pass"]
    both = ort_passes.count("passed")
    share = 100 * both / len(ort_passes) if ort_passes else 0.0
    write = terminalreporter.write_line
    terminalreporter.section("ONNX node conformance suite (string and ai.onnx.ml cases excluded)")
    write(f"{len(outcomes)} cases ({skipped} more skipped): ranvier passes {ranvier['passed']}, refuses {ranvier['refused']}, "
          f"fails {ranvier['failed']} (a wrong result or an error other than a refusal)")
    write(f"ONNX Runtime passes {len(ort_passes)}; ranvier passes {both} of those ({share:.1f}%)")
    operators = sum(n for reason, n in refusals.items() if reason.startswith("operator "))
    write(f"refused: {operators} for a missing operator ({sum(1 for r in refusals if r.startswith('operator '))} "
          "operators), the rest by reason:")
    for reason, count in refusals.most_common():
        if not reason.startswith("operator "):
            write(f"  {count:4d}  {reason}")
