"""The zero-bubble split of one microbatch's backward into I (inputs) and W (weights).

[Note: W accumulates through the leaves]
I computes the gradient w.r.t. the stage's inputs only, on the critical path;
W, later, the gradient w.r.t. the weights. W must look to a data-parallel wrapper
exactly like the parameter half of an ordinary backward: `DataParallel` launches a
bucket when its parameters' post-accumulate-grad hooks have fired, `fully_shard`
reduce-scatters a unit when all of its parameters' hooks have fired. So W never
assigns ``.grad`` itself (torch's ``stage_backward_weight`` does, and the hooks stay
silent); it runs ``torch.autograd.backward(..., inputs=weights)``, which accumulates
through each parameter's own AccumulateGrad node, so every hook fires once per W,
as in a full backward.

The weights are the leaves the autograd graph actually reaches (AccumulateGrad
nodes other than the stage inputs), not ``module.parameters()``: under
`fully_shard` the module may hold its sharded parameters at the moment I runs,
while the graph holds the unsharded ones the forward used.

How W avoids redoing I's work (the same idea as torch's helpers): during I a
pre-hook on every *boundary* node (a node on the path from the roots to the
inputs that also leads to a weight, e.g. the ``addmm`` of a Linear) saves the
gradient flowing into it. W re-runs only those nodes and the weight side below
them, seeded with the saved gradients. Weights whose boundary sets overlap form
one group, run as one autograd call: running every group in one call would make
each boundary node recompute its input-side gradient too (the engine cannot know
that a later boundary is seeded), i.e. the whole of I again. Inside a group,
pre-hooks pin every boundary node's incoming gradient to the saved one, so a
boundary below another is not counted twice. Weights that reach the roots
without crossing the input path (stage 0, whose inputs need no gradient, or an
output that depends on weights only) are done by one backward from the roots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SplitBackward", "backward_input"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    nodes: list[Node]
    weights: list[torch.Tensor]
    saved: list[Grads | None] = field(default_factory=list)


@dataclass
class SplitBackward:
    """What I keeps for W: the boundary groups and, if any, the root-side remainder."""

    groups: list[_Group]
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor] | None
    residual: list[torch.Tensor]

    def run_weight(self) -> None:
        """W: accumulate every weight's gradient through its AccumulateGrad node."""
        for g in self.groups:
            edges, seeds = [], []
            for node, saved in zip(g.nodes, g.saved):
                for i, grad in enumerate(saved or ()):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        seeds.append(grad)
            if not edges:
                continue
            handles = []
            if len(g.nodes) > 1:
                for node, saved in zip(g.nodes, g.saved):
                    handles.append(node.register_prehook(lambda _, s=saved: s))
            try:
                torch.autograd.backward(edges, grad_tensors=seeds, inputs=g.weights)
            finally:
                for h in handles:
                    h.remove()
        if self.residual:
            torch.autograd.backward(self.roots, grad_tensors=self.root_grads, inputs=self.residual)
        self.groups, self.roots, self.residual = [], [], []


def _node(t: torch.Tensor) -> Node | None:
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:  # a leaf: its AccumulateGrad node, reached through a view
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]  # a view of a grad-requiring leaf has a grad_fn
    return None


def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
) -> tuple[Grads, SplitBackward]:
    """I: the gradients of ``inputs`` (leaves requiring grad), and what W needs."""
    roots = list(roots)
    rgrads = None if root_grads is None else list(root_grads)
    input_nodes = {n for n in map(_node, inputs) if n is not None}
    parents, leaves, seen = _reverse_graph(roots, input_nodes)
    on_path = _input_path(input_nodes & seen, parents)
    groups, residual = _group_weights(leaves, parents, on_path)
    grads = _input_grads(roots, rgrads, inputs, groups)
    if not residual:  # nothing goes back through the roots: let them go now
        roots, rgrads = [], None
    return grads, SplitBackward(groups, roots, rgrads, residual)


def _reverse_graph(
    roots: Sequence[torch.Tensor], input_nodes: set[Node]
) -> tuple[dict[Node, list[Node]], dict[Node, torch.Tensor], set[Node]]:
    """The graph reversed (node -> parents), its weight leaves and every node reached.

    One walk from the roots serves every later phase: the input path and each
    weight's boundary are both searched upwards, through ``parents``.
    """
    parents: dict[Node, list[Node]] = {}
    leaves: dict[Node, torch.Tensor] = {}
    queue = deque(n for n in map(_node, roots) if n is not None)
    seen = set(queue)
    while queue:
        node = queue.popleft()
        var = getattr(node, "variable", None)
        if var is not None and node not in input_nodes:
            leaves[node] = var
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return parents, leaves, seen


def _input_path(reached_inputs: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes on a path from the roots to an input: what I must run, and W must not."""
    on_path = set(reached_inputs)
    queue = deque(on_path)
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p not in on_path:
                on_path.add(p)
                queue.append(p)
    return on_path


def _boundary(leaf: Node, parents: dict[Node, list[Node]], on_path: set[Node]) -> set[Node]:
    """Where a weight's side of the graph joins the input path: the nodes W re-runs."""
    boundary: set[Node] = set()
    walked = {leaf}
    queue = deque([leaf])
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p in on_path:
                boundary.add(p)
            elif p not in walked:
                walked.add(p)
                queue.append(p)
    return boundary


def _group_weights(
    leaves: dict[Node, torch.Tensor], parents: dict[Node, list[Node]], on_path: set[Node]
) -> tuple[list[_Group], list[torch.Tensor]]:
    """Weights whose boundaries overlap, grouped (one autograd call each), and the rest.

    The rest (the residual) reaches the roots without crossing the input path; see
    [Note: W accumulates through the leaves] for why groups must not be merged further.
    """
    owner: dict[Node, int] = {}  # boundary node -> group id
    members: list[tuple[set[Node], list[torch.Tensor]]] = []
    residual: list[torch.Tensor] = []
    for leaf, weight in leaves.items():
        boundary = _boundary(leaf, parents, on_path)
        if not boundary:
            residual.append(weight)
            continue
        keep = _merge_groups(sorted({owner[b] for b in boundary if b in owner}), owner, members)
        members[keep][0].update(boundary)
        members[keep][1].append(weight)
        for b in boundary:
            owner[b] = keep
    groups = [_Group(list(nodes), ws) for nodes, ws in members if ws]
    for g in groups:
        g.saved = [None] * len(g.nodes)
    return groups, residual


def _merge_groups(
    ids: list[int],
    owner: dict[Node, int],
    members: list[tuple[set[Node], list[torch.Tensor]]],
) -> int:
    """The group a weight joins: every group it touches merged into the first, or a new one."""
    if not ids:
        members.append((set(), []))
        return len(members) - 1
    keep = ids[0]
    for j in ids[1:]:
        nodes, ws = members[j]
        members[keep][0].update(nodes)
        members[keep][1].extend(ws)
        members[j] = (set(), [])
        for b in nodes:
            owner[b] = keep
    return keep


def _input_grads(
    roots: list[torch.Tensor],
    rgrads: list[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    groups: list[_Group],
) -> Grads:
    """I proper: the input gradients, saving what flows into each boundary node for W."""
    handles = []
    for g in groups:
        for i, node in enumerate(g.nodes):

            def save(grad_outputs: Grads, g: _Group = g, i: int = i) -> None:
                g.saved[i] = tuple(grad_outputs)

            handles.append(node.register_prehook(save))
    want = [t for t in inputs if t.requires_grad]
    dins: Grads
    try:
        if want and roots:
            dins = torch.autograd.grad(roots, want, rgrads, retain_graph=True, allow_unused=True)
        else:
            dins = (None,) * len(want)
    finally:
        for h in handles:
            h.remove()
    out = iter(dins)
    return tuple(next(out) if t.requires_grad else None for t in inputs)
