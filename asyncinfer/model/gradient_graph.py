"""The graph a ``Gradient`` node differentiates (domain ``ai.onnx.preview.training``).

A Gradient node does not hold a subgraph: it names values of the graph it sits in (``xs``, ``zs``,
``y``), and its inputs are the values at which ``y`` is differentiated. The importer gives it one:
the nodes of its graph that compute ``y`` from ``xs`` and ``zs``, as the graph attribute
`FORWARD` whose inputs are ``xs + zs`` (bound to the node's inputs by position) and whose output is
``y``. Every other value those nodes read (initializers, other graph values) comes from the
enclosing graph, as an If body's outer values do, and is a constant of the differentiation. The
opsets the nodes were written for go with it (`FORWARD_OPSETS`), so they run as in the model.
"""
from __future__ import annotations

import onnx
from onnx import AttributeProto, helper

from ..errors import ModelLoadError, UnsupportedOperatorError

TRAINING_DOMAIN = "ai.onnx.preview.training"
#: The graph attribute the importer adds to a Gradient node (not a name of the op's schema).
FORWARD = "_forward_graph"
#: The layer attribute holding ``{domain: opset}`` of the forward graph's nodes.
FORWARD_OPSETS = "_forward_opsets"


def is_gradient(op_type: str, domain: str) -> bool:
    """Whether a node is ``ai.onnx.preview.training::Gradient``."""
    return op_type == "Gradient" and domain == TRAINING_DOMAIN


def _strings(node: onnx.NodeProto, name: str) -> list[str]:
    for attr in node.attribute:
        if attr.name == name:
            values = [attr.s] if attr.type == AttributeProto.STRING else list(attr.strings)
            return [v.decode("utf-8", errors="replace") for v in values]
    return []


def producers(graph: onnx.GraphProto) -> dict[str, int]:
    """The index of the node producing each value of ``graph`` (computed once per graph)."""
    return {out: i for i, n in enumerate(graph.node) for out in n.output if out}


def with_forward_graph(node: onnx.NodeProto, graph: onnx.GraphProto, producer: dict[str, int],
                       where: str) -> tuple[onnx.NodeProto, int]:
    """A copy of Gradient ``node`` of ``graph`` with its forward graph as attribute `FORWARD`, and
    the number of nodes copied into it (the caller bounds their total). ``producer`` is
    `producers` of ``graph``.

    Raises ModelLoadError for names that do not fit (repeated, or as many inputs as ``xs`` and
    ``zs`` name), UnsupportedOperatorError for a Gradient of a Gradient (higher orders)."""
    xs, zs, ys = _strings(node, "xs"), _strings(node, "zs"), _strings(node, "y")
    sources = xs + zs
    if len(ys) != 1 or not xs:
        raise ModelLoadError(f"{where}: a Gradient names one y and at least one x, got y={ys}, xs={xs}")
    if len(set(sources)) != len(sources):
        raise ModelLoadError(f"{where}: xs and zs name a value twice: {sources}")
    if len(node.input) != len(sources):
        raise ModelLoadError(f"{where}: {len(node.input)} inputs for the {len(sources)} values named by xs and zs")
    if len(node.output) > len(xs):
        raise ModelLoadError(f"{where}: {len(node.output)} outputs for the {len(xs)} values named by xs")
    needed: set[int] = set()
    stack, seen = [ys[0]], set(sources)
    while stack:  # back from y to xs, zs and the values of the enclosing scope
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        index = producer.get(name)
        if index is not None and index not in needed:
            needed.add(index)
            stack.extend(n for n in graph.node[index].input if n)
    nodes = [graph.node[i] for i in sorted(needed)]  # the graph's own (topological) order
    if any(is_gradient(n.op_type, n.domain) for n in nodes):
        raise UnsupportedOperatorError([f"{where}: the gradient of a Gradient's output (a second-order "
                                        "derivative) is not supported"])
    forward = helper.make_graph(nodes, f"{node.name or 'Gradient'}_forward",
                                [helper.make_empty_tensor_value_info(n) for n in sources],
                                [helper.make_empty_tensor_value_info(ys[0])])
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.attribute.append(helper.make_attribute(FORWARD, forward))
    return copy, len(nodes)
