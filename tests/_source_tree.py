"""cadence's source tree read as data: its modules and what each one imports.

Shared by the architecture tests, so the cycle check and the allowed-imports table
read imports the same way. Nothing here imports cadence or torch: the files are
parsed with `ast`, never executed.

An import counts wherever it is written: at module level, inside a function (run on
first call) or under ``if TYPE_CHECKING:`` (run by type checkers only). Each
`Import` says which of those it is, because "which modules may import which" counts
them all, while "does importing this module load torch" counts only those that run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "cadence"

# The parts of the torch.distributed namespace that are torch features of their own
# (DTensor, DeviceMesh, FSDP2, DCP, torch pipelining, Join). Anything else under
# torch.distributed is its process-group API: groups, collectives, ranks.
DIST_SUBSYSTEMS = frozenset(
    {"algorithms", "checkpoint", "device_mesh", "fsdp", "pipelining", "tensor"}
)


@dataclass(frozen=True)
class Import:
    """One imported module, as the importing file names it."""

    target: str  # dotted module name (a cadence module, or e.g. "torch.distributed")
    line: int
    at_import: bool  # runs when the importing module is imported
    type_only: bool  # under ``if TYPE_CHECKING:``: never runs
    attribute: bool = False  # not an import: ``torch.distributed.x`` after ``import torch``


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> str:
    """``cadence.pipeline.runtime`` -> ``pipeline/runtime/__init__.py`` (under src/cadence)."""
    path = modules()[name]
    return path.relative_to(PACKAGE).as_posix()


@cache
def modules() -> dict[str, Path]:
    """Every module under src/cadence, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _dist_namespace(dotted: str) -> str | None:
    """The torch.distributed part a dotted name belongs to, or None outside it."""
    parts = dotted.split(".")
    if parts[:2] != ["torch", "distributed"]:
        return None
    if len(parts) > 2 and parts[2] in DIST_SUBSYSTEMS:
        return ".".join(parts[:3])
    return "torch.distributed"


class _Collector(ast.NodeVisitor):
    """Every import statement of one file, and every ``torch.distributed.x`` reached as
    an attribute (``import torch`` then ``torch.distributed.get_rank()``)."""

    def __init__(self, name: str, is_package: bool, known: frozenset[str]) -> None:
        self.package = name if is_package else name.rpartition(".")[0]
        self.known = known
        self.depth = 0  # functions around the node
        self.type_only = 0  # TYPE_CHECKING blocks around the node
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.expr | ast.stmt, attribute: bool = False) -> None:
        at_import = self.depth == 0 and not self.type_only
        self.found.append(Import(target, node.lineno, at_import, bool(self.type_only), attribute))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function
    visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.type_only += 1
        for child in node.body:
            self.visit(child)
        self.type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        for alias in node.names:
            # ``from pkg import sub`` imports the submodule when there is one.
            # The same for torch's: ``from torch.distributed import tensor``.
            sub = f"{mod}.{alias.name}"
            submodule = (
                sub in self.known
                or sub == "torch.distributed"
                or (mod == "torch.distributed" and alias.name in DIST_SUBSYSTEMS)
            )
            self._add(sub if submodule else mod, node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name):
            dotted = ".".join([value.id, *reversed(chain)])
            namespace = _dist_namespace(dotted)
            if namespace is not None:
                self._add(namespace, node, attribute=True)
                return  # the outermost attribute named the whole chain
        self.generic_visit(node)


@cache
def imports(name: str) -> tuple[Import, ...]:
    """Every import written in module ``name``, in file order."""
    path = modules()[name]
    collector = _Collector(name, path.name == "__init__.py", frozenset(modules()))
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return tuple(sorted(collector.found, key=lambda i: i.line))


def owner(target: str) -> str | None:
    """The cadence module an import target lands in (``cadence.comm.Comm`` -> ``cadence.comm``)."""
    known = modules()
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def cadence_imports(name: str) -> dict[str, Import]:
    """The other cadence modules ``name`` imports, each with its first import."""
    out: dict[str, Import] = {}
    for imp in imports(name):
        if not (imp.target == "cadence" or imp.target.startswith("cadence.")):
            continue
        target = owner(imp.target)
        if target and target != name:
            out.setdefault(target, imp)
    return out


def torch_imports(name: str) -> list[Import]:
    """The import statements of torch (or any part of it) in module ``name``."""
    return [
        i
        for i in imports(name)
        if not i.attribute and (i.target == "torch" or i.target.startswith("torch."))
    ]


def dist_namespace(target: str) -> str | None:
    return _dist_namespace(target)
