"""Split backward for ``I``/``W`` without a second traversal of the graph.

``backward_input`` computes the input gradients only (the engine runs just the nodes on a
path to the stage's inputs, each computing only the gradients that lead there) and, on the
way, keeps the gradient that flows into every *parameter node*: for each parameter, the
nodes where its own branch of the graph joins the inputs' path (a ``Linear``'s ``addmm``,
a norm's ``native_layer_norm``). ``backward_weight`` then back-propagates from those
nodes, with the kept gradients, into the parameters only: each parameter node runs once
more for its weight-side outputs, nothing between it and the stage's output runs again.
So ``I`` then ``W`` does the work of one ``B`` (plus the graph walk).

Invariants: the weight gradients equal ``B``'s (accumulated into ``.grad``); the graph
stays alive until ``W`` (the forward's stored activation, which the memory model frees at
``W``; ``W`` frees each part as it runs it), and what ``I`` adds to it is one gradient per
parameter node output. A parameter
group whose parameter nodes feed one another (a weight used twice along one path) would
count a contribution twice from its nodes, so it back-propagates from the stage's output
instead (correct, at the cost of a full traversal for that group).
"""

from __future__ import annotations

from collections import defaultdict

import attrs
import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@attrs.frozen
class WeightWork:
    """What ``W`` needs: per parameter group, the roots to start from (edges of parameter
    nodes, or the stage's output), the gradients kept there, and the group's parameters."""

    groups: tuple[tuple[tuple, tuple, tuple], ...]


def backward_input(output: torch.Tensor, grad, leaves: tuple, params: tuple
                   ) -> tuple[tuple, WeightWork]:
    """Input gradients of ``leaves`` (graph retained) and what ``W`` needs."""
    root = output.grad_fn
    parents = _parents(root)
    on_input_path = _ancestors([get_gradient_edge(x).node for x in leaves], parents)
    nodes: dict[Node, list] = defaultdict(list)  # parameter node -> its parameters
    fallback = []
    for p in params:
        node = get_gradient_edge(p).node
        if node not in parents and node is not root:
            continue  # not used by this forward: no gradient, as with B
        joins = _joins(node, on_input_path, parents)
        if joins:
            for j in joins:
                nodes[j].append(p)
        else:
            fallback.append(p)
    kept: dict[Node, tuple] = {}
    handles = [n.register_prehook(_keeper(kept, n)) for n in nodes]
    try:
        grads = torch.autograd.grad(output, list(leaves), grad, retain_graph=True,
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return tuple(grads), WeightWork(_groups(nodes, kept, fallback, output, grad, parents))


def weight_only(output: torch.Tensor, grad, params: tuple) -> WeightWork:
    """``W``'s work when ``I`` has no input gradient to compute: the whole backward."""
    return WeightWork((((output,), (grad,), tuple(params)),) if params else ())


def backward_weight(work: WeightWork) -> None:
    """Accumulate the weight gradients into ``.grad``. Each call frees the graph parts it
    ran (no later call needs them: groups share no node), except a call that starts at
    the stage output, which runs first and keeps the graph for the others."""
    last = len(work.groups) - 1
    for index, (roots, grads, params) in enumerate(work.groups):
        from_output = type(roots[0]) is torch.Tensor
        torch.autograd.backward(list(roots), list(grads), inputs=list(params),
                                retain_graph=from_output and index < last)


def _keeper(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = grad_outputs
    return hook


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root`` -> the nodes that pass it a gradient."""
    parents: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(starts: list[Node], parents: dict) -> set:
    """The nodes with a path to one of ``starts`` (the starts included)."""
    seen = set(starts)
    stack = list(starts)
    while stack:
        for up in parents.get(stack.pop(), ()):
            if up not in seen:
                seen.add(up)
                stack.append(up)
    return seen


def _joins(node: Node, on_input_path: set, parents: dict) -> list[Node]:
    """Walking up from a parameter's node: the first nodes on the inputs' path."""
    found, seen, stack = [], {node}, [node]
    while stack:
        for up in parents.get(stack.pop(), ()):
            if up in seen:
                continue
            seen.add(up)
            if up in on_input_path:
                found.append(up)
            else:
                stack.append(up)
    return found


def _groups(nodes: dict, kept: dict, fallback: list, output, grad, parents) -> tuple:
    """Parameters sharing parameter nodes form one group (one backward call each)."""
    owner: dict[int, int] = {}  # id(param) -> group index
    members: list[tuple[list, list]] = []  # (nodes, params)
    for node, ps in nodes.items():
        hit = sorted({owner[id(p)] for p in ps if id(p) in owner})
        if hit:
            target = hit[0]
            for other in hit[1:]:  # merge groups joined through this node
                members[target][0].extend(members[other][0])
                members[target][1].extend(members[other][1])
                for p in members[other][1]:
                    owner[id(p)] = target
                members[other] = ([], [])
        else:
            target = len(members)
            members.append(([], []))
        members[target][0].append(node)
        for p in ps:
            if id(p) not in owner:
                owner[id(p)] = target
                members[target][1].append(p)
    out, fallback = [], list(fallback)  # the group from the output goes first
    for group_nodes, ps in members:
        if not ps:
            continue
        if len(group_nodes) > 1 and _feed_each_other(group_nodes, parents):
            fallback.extend(ps)
            continue
        roots, grads = [], []
        for node in group_nodes:
            for i, g in enumerate(kept.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    grads.append(g)
        if roots:
            out.append((tuple(roots), tuple(grads), tuple(ps)))
    head = (((output,), (grad,), tuple(fallback)),) if fallback else ()
    return head + tuple(out)


def _feed_each_other(group_nodes: list, parents: dict) -> bool:
    """Does one of these nodes pass a gradient, directly or not, to another?"""
    targets = set(group_nodes)
    for node in group_nodes:
        above = _ancestors([node], parents) - {node}
        if above & targets:
            return True
    return False
