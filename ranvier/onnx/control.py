"""Converters of ONNX's control flow, resolved at load: If takes the branch its condition
(known at load) names, and Loop and Scan are unrolled, their bodies converted once per
iteration into the flow (Loop's trip count and its condition after each iteration must be
known at load; Scan's length is its inputs' static size). Inside a body the model's other
values stay visible, as ONNX scopes them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .node import Node, Value, converts

MAX_ITERATIONS = 4096  # a Loop unrolled further would hold a body per iteration in one flow


def _run_body(node: Node, graph: onnx.GraphProto, bound: dict[str, Value]) -> list[Value]:
    """The values of `graph`'s outputs, its nodes converted into the flow with its inputs
    bound to `bound` (by the body's input names)."""
    importer = node.importer
    # The body's names hold new values each iteration: forget the constants made of the last.
    for name in [*bound, *(t.name for t in graph.initializer), *(o for proto in graph.node for o in proto.output)]:
        importer.constant_vars.pop(name, None)
    importer.values.update(bound)
    importer.values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer})
    for proto in graph.node:
        importer.convert(proto)
    return [importer.values[output.name] for output in graph.output]


def _stacked(node: Node, parts: list[Value], axis: int) -> Value:
    """Per-iteration values joined along a new axis."""
    if all(isinstance(part, np.ndarray) for part in parts):
        return np.stack(parts, axis=axis)
    tensors = [node.importer.as_tensor(part, "") for part in parts]
    spread = [t.reshape([*t.shape[:axis], 1, *t.shape[axis:]]) for t in tensors]
    return spread[0] if len(spread) == 1 else node.b.concat(spread, axis)


@converts("If")
def if_(node: Node):
    condition = node.constant(0, "condition (the branch is chosen at load)")
    taken = bool(np.asarray(condition).reshape(-1)[0])
    node.attr("else_branch" if taken else "then_branch")  # the branch not taken is read, and dropped
    return _run_body(node, node.attr("then_branch" if taken else "else_branch"), {})


@converts("Loop")
def loop(node: Node):
    """Iterations while the trip count (if any) is not reached and the condition holds;
    each binds the iteration number, the condition and the carried values to the body's
    inputs, which gives the next condition, the carried values and the scan outputs
    (stacked along a new first axis)."""
    body = node.attr("body")
    count = int(node.constant(0, "trip count").item()) if node.optional(0) is not None else None
    going = bool(node.constant(1, "condition").item()) if node.optional(1) is not None else True
    carried = [node.inputs[i] for i in range(2, len(node.inputs))]
    names = [value.name for value in body.input]
    scans: list[list[Value]] = []
    iteration = 0
    while going and (count is None or iteration < count):
        if iteration == MAX_ITERATIONS:
            raise node.error(f"runs past {MAX_ITERATIONS} iterations; ranvier unrolls loops at load")
        bound = {names[0]: np.asarray(iteration, np.int64), names[1]: np.asarray(going)}
        bound.update(zip(names[2:], carried))
        outputs = _run_body(node, body, bound)
        condition, carried, scanned = outputs[0], outputs[1:1 + len(carried)], outputs[1 + len(carried):]
        if not isinstance(condition, np.ndarray):
            raise node.error("its body computes the loop's condition from the model's inputs; ranvier unrolls loops "
                             "at load, so it must be known there")
        going = bool(condition.reshape(-1)[0])
        scans = scans or [[] for _ in scanned]
        for collected, value in zip(scans, scanned):
            collected.append(value)
        iteration += 1
    if not iteration and len(body.output) > 1 + len(carried):
        raise node.error("runs no iteration, so its scan outputs would be empty; ranvier does not hold empty tensors")
    return carried + [_stacked(node, collected, 0) for collected in scans]


@converts("Scan")
def scan(node: Node):
    """The body once per position along the scan inputs' axes (forward or reverse): it
    takes the states and each scan input's slice, and gives the next states and a slice
    of each scan output, stacked along its output axis (in reverse for a reverse one)."""
    if node.opset < 9:
        raise node.error("opset 8's Scan (batched, with sequence_lens) is not supported; opset 9's is")
    body = node.attr("body")
    scanned = int(node.attr("num_scan_inputs"))
    states = [node.inputs[i] for i in range(len(node.inputs) - scanned)]
    inputs = [node.tensor(i) for i in range(len(states), len(node.inputs))]
    input_axes = [node.axis(a, x.rank) for a, x in zip(node.attr("scan_input_axes", [0] * scanned), inputs)]
    input_reversed = list(node.attr("scan_input_directions", [0] * scanned))
    lengths = {x.shape[axis] for x, axis in zip(inputs, input_axes)}
    if len(lengths) != 1:
        raise node.error(f"its scan inputs have lengths {sorted(lengths)} along their axes; Scan needs one")
    (length,) = lengths
    names = [value.name for value in body.input]
    collected: list[list[Value]] = [[] for _ in range(len(body.output) - len(states))]
    for step in range(length):
        bound = dict(zip(names, states))
        for name, x, axis, backwards in zip(names[len(states):], inputs, input_axes, input_reversed):
            at = length - 1 - step if backwards else step
            begin = [at if i == axis else 0 for i in range(x.rank)]
            size = [1 if i == axis else d for i, d in enumerate(x.shape)]
            bound[name] = node.b.slice(x, begin, size).reshape([d for i, d in enumerate(x.shape) if i != axis])
        outputs = _run_body(node, body, bound)
        states = outputs[:len(states)]
        for parts, value in zip(collected, outputs[len(states):]):
            parts.append(value)
    output_reversed = list(node.attr("scan_output_directions", [0] * len(collected)))
    output_axes = list(node.attr("scan_output_axes", [0] * len(collected)))
    results = []
    for parts, axis, backwards in zip(collected, output_axes, output_reversed):
        rank = np.ndim(parts[0]) if isinstance(parts[0], np.ndarray) else parts[0].rank
        results.append(_stacked(node, parts[::-1] if backwards else parts, node.axis(axis, rank + 1)))
    return states + results
