"""Split backward for ``I``/``W`` without a second traversal of the graph.

``backward_input`` computes the input gradients only (the engine runs just the nodes on a
path to the stage's inputs, each computing only the gradients that lead there) and, on the
way, keeps the gradient that flows into every *parameter node*: for each parameter, the
nodes where its own branch of the graph joins the inputs' path (a ``Linear``'s ``addmm``,
a norm's ``native_layer_norm``). A direct node's gradient is a pre-hook's copy (taken
after the tensor hooks on the node's output, as its own backward reads it); any other
node's is one more output of the same ``autograd.grad`` call (an edge input, taken before
those hooks, which run again with the node in ``W``).
``backward_weight`` then computes the weight gradients from those kept gradients, in one
of two forms per parameter node:

- *direct*: a ``Linear`` (``addmm`` or ``mm`` of a contiguous weight, transposed, with
  ``alpha = beta = 1``) or a ``layer_norm`` whose parameters are used nowhere else and
  carry no hooks (tensor or post-accumulate hooks; a stage holding a
  ``DistributedDataParallel`` module, whose hooks sit unseen on the gradient
  accumulators, keeps the autograd form: ``direct_allowed``). ``W`` calls the kernels
  the node's own backward calls for its weight outputs, on the kept gradient ``G`` and
  the input the node saved: ``G^T X`` and the rows' sum of ``G`` (the bias),
  ``native_layer_norm_backward`` with the input gradient masked off. No autograd call,
  no graph walk.
- *autograd*: any other parameter node: a backward from the node's edges, with the kept
  gradients, into its parameters only (each parameter node runs once more for its
  weight-side outputs; nothing between it and the stage's output runs again). A group
  whose parameter nodes feed one another (a weight used twice along one path) would
  count a contribution twice, so it back-propagates from the stage's output instead
  (correct, at the cost of a full traversal for that group).

Invariants: the weight gradients are the plain backward's, bitwise (accumulated into
``.grad`` as ``AccumulateGrad`` does); ``I`` leaves every ``.grad`` alone. Memory: when
every parameter node has the direct form, ``I`` does not retain the graph (each node's
saved tensors are freed as ``I`` runs it) and what lives until ``W`` is, per parameter
node, its saved input and the kept gradient, each dropped as soon as ``W`` has used it;
otherwise the graph stays alive until ``W`` (with the kept gradients), as before. Either
way it is what the forward stored plus the kept gradients, held until ``W`` (the memory
model counts the stored activation from ``F`` to ``W``).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_ACCUMULATE = torch._C._functions.AccumulateGrad  # a leaf's (a parameter's) node


class WeightWork:
    """What ``W`` needs, consumed by one ``backward_weight``: ``direct``, a list of
    ``(compute, kept gradient, saved inputs, parameters)``; ``groups``, per autograd
    parameter group, ``(roots, kept gradients, parameters)`` (roots: edges of parameter
    nodes, or the stage's output)."""

    __slots__ = ("direct", "groups")

    def __init__(self, direct: list | None = None, groups: tuple = ()) -> None:
        self.direct, self.groups = direct or [], groups


def direct_allowed(module: torch.nn.Module) -> bool:
    """Whether ``W`` may use direct forms for ``module``'s parameters: not when a
    ``DistributedDataParallel`` inside it hooks their gradient accumulators (its hooks
    are not visible on the parameters, and a direct form would not run them)."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    return ddp is None or not any(isinstance(m, ddp.DistributedDataParallel)
                                  for m in module.modules())


def backward_input(output: torch.Tensor, grad, leaves: tuple, params: tuple,
                   allow_direct: bool = True) -> tuple[tuple, WeightWork]:
    """Input gradients of ``leaves`` and what ``W`` needs (the graph retained only when
    some parameter node has no direct form; ``allow_direct=False``: none has)."""
    root = output.grad_fn
    parents = _parents(root)
    on_input_path = _ancestors([get_gradient_edge(x).node for x in leaves], parents)
    nodes: dict[Node, list] = defaultdict(list)  # parameter node -> its parameters
    fallback = []
    accumulators = {id(n.variable): n for n in parents if type(n) is _ACCUMULATE}
    for p in params:
        node = accumulators.get(id(p))
        if node is None:
            continue  # not used by this forward: no gradient, as with B
        joins = _joins(node, on_input_path, parents)
        if joins:
            for j in joins:
                nodes[j].append(p)
        else:
            fallback.append(p)
    direct, rest = {}, {}
    for node, ps in nodes.items():
        form = _direct_form(node, ps, parents) if allow_direct else None
        if form is None:
            rest[node] = ps
        else:
            direct[node] = form
    # A direct node's gradient is what its own backward would read: taken by a pre-hook,
    # which runs after the tensor hooks on the node's output (a hook scaling a Linear's
    # output gradient counts once, as in B). An autograd node's gradients are captured
    # as edge inputs, before those hooks: W runs the node again, and the hooks with it.
    taken: dict[Node, tuple] = {}
    handles = [n.register_prehook(_keeper(taken, n)) for n in direct]
    edges = [GradientEdge(n, i) for n in rest for i in _inputs_of(n, parents, output)]
    try:
        grads = torch.autograd.grad(output, [*leaves, *edges], grad,
                                    retain_graph=bool(rest or fallback), allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    work = [(compute, taken[n][0], saved, ps) for n, (compute, saved, ps) in direct.items()
            if n in taken and taken[n][0] is not None]
    kept = dict(zip(((e.node, e.output_nr) for e in edges), grads[len(leaves):]))
    return (tuple(grads[:len(leaves)]),
            WeightWork(work, _groups(rest, kept, fallback, output, grad, parents)))


def _inputs_of(node: Node, parents: dict, output: torch.Tensor) -> list[int]:
    """The indices of ``node``'s gradient inputs that some node, or the stage output,
    passes it."""
    given = {output.output_nr} if node is output.grad_fn else set()
    return sorted(given | {nr for up in parents.get(node, ()) for n, nr in up.next_functions
                           if n is node})


def weight_only(output: torch.Tensor, grad, params: tuple) -> WeightWork:
    """``W``'s work when ``I`` has no input gradient to compute: the whole backward."""
    return WeightWork(groups=(((output,), (grad,), tuple(params)),) if params else ())


def backward_weight(work: WeightWork) -> None:
    """Accumulate the weight gradients into ``.grad``; ``work`` is used up. Each direct
    form's tensors are dropped once used; each autograd call frees the graph parts it ran
    (no later call needs them: groups share no node), except a call that starts at the
    stage output, which runs first and keeps the graph for the others."""
    direct, work.direct = work.direct, []
    with torch.no_grad():
        while direct:
            compute, g, saved, params = direct.pop()
            for p, value in zip(params, compute(g, *saved)):
                _accumulate(p, value)
            del compute, g, saved, params
    last = len(work.groups) - 1
    for index, (roots, grads, params) in enumerate(work.groups):
        from_output = type(roots[0]) is torch.Tensor
        torch.autograd.backward(list(roots), list(grads), inputs=list(params),
                                retain_graph=from_output and index < last)
    work.groups = ()


def _accumulate(p: torch.Tensor, value: torch.Tensor) -> None:
    """``AccumulateGrad`` without hooks: the first gradient is taken as it is, later ones
    added in place."""
    if p.grad is None:
        p.grad = value
    else:
        p.grad += value


# ---------------------------------------------------------------- direct forms


def _direct_form(node: Node, ps: list, parents: dict) -> tuple | None:
    """``(compute, saved inputs, parameters)`` when ``node`` is a parameter node with a
    direct form whose parameters are exactly ``ps``; else None."""
    make = _FORMS.get(node.name())
    form = make(node, parents) if make is not None else None
    if form is None or {id(p) for p in form[2]} != {id(p) for p in ps}:
        return None
    return form


def _own_param(edge_node, via: Node, parents: dict):
    """The parameter whose ``AccumulateGrad`` is ``edge_node`` when it takes gradients
    from ``via`` alone and has no hooks (its gradient is then ``via``'s alone); else
    None."""
    p = getattr(edge_node, "variable", None)
    if p is None or parents.get(edge_node) != [via] or not p.is_floating_point():
        return None
    if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
        return None
    return p


def _linear_form(node: Node, parents: dict, mat1: str, bias_edge) -> tuple | None:
    """``x @ W.t() (+ b)``: the weight's branch is ``TBackward0`` of a contiguous 2-d
    parameter; the bias (``bias_edge`` None: none that takes a gradient) a 1-d parameter
    of its own."""
    t = node.next_functions[-1][0]
    if t is None or t.name() != "TBackward0" or parents.get(t) != [node]:
        return None
    w = _own_param(t.next_functions[0][0], t, parents)
    if w is None or w.dim() != 2 or not w.is_contiguous():
        return None
    x = getattr(node, mat1)
    if bias_edge is None:
        return _weight_grad, (x,), (w,)
    b = _own_param(bias_edge, node, parents)
    if b is None or b.shape != (w.shape[0],):  # a broadcast bias: autograd
        return None
    return _weight_and_bias_grads, (x,), (w, b)


def _addmm_form(node: Node, parents: dict) -> tuple | None:
    if node._saved_alpha != 1 or node._saved_beta != 1:
        return None
    return _linear_form(node, parents, "_saved_mat1", node.next_functions[0][0])


def _mm_form(node: Node, parents: dict) -> tuple | None:
    return _linear_form(node, parents, "_saved_self", None)


def _weight_grad(g, x):
    return (g.t().mm(x),)  # what mm_mat2_backward computes for a transposed weight


def _weight_and_bias_grads(g, x):
    return g.t().mm(x), g.sum(0)


def _layer_norm_form(node: Node, parents: dict) -> tuple | None:
    """``native_layer_norm``: only its first output used, weight and bias parameters of
    its own (either may be absent)."""
    if any(nr != 0 for up in parents.get(node, ()) for n, nr in up.next_functions
           if n is node):
        return None  # someone reads the mean or rstd: autograd
    _, w_edge, b_edge = node.next_functions
    ps, mask = [], [False, False, False]
    for i, edge in ((1, w_edge[0]), (2, b_edge[0])):
        if edge is not None:
            p = _own_param(edge, node, parents)
            if p is None:
                return None
            ps.append(p)
            mask[i] = True
    if not ps:
        return None
    saved = (node._saved_input, node._saved_normalized_shape, node._saved_result1,
             node._saved_result2, node._saved_weight, node._saved_bias, tuple(mask))
    return _layer_norm_grads, saved, tuple(ps)


def _layer_norm_grads(g, x, shape, mean, rstd, weight, bias, mask):
    out = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, weight, bias,
                                                    list(mask))
    return tuple(v for v, wanted in zip(out, mask) if wanted)


_FORMS = {"AddmmBackward0": _addmm_form, "MmBackward0": _mm_form,
          "NativeLayerNormBackward0": _layer_norm_form}


# ---------------------------------------------------------------- the graph


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
            ups = parents.get(child)
            if ups is None:
                parents[child] = [node]
                stack.append(child)
            else:
                ups.append(node)
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
        roots, grads, in_group = [], [], set(group_nodes)
        for (node, i), g in kept.items():
            if g is not None and node in in_group:
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
