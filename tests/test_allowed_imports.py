"""The allowed-imports table: which cadence module may import which, and torch.

Specification (no process group, no torch: the source is parsed, never run):

- Every module under ``src/cadence`` belongs to a room of `ROOMS` (a file, or a
  folder ending in ``/``; the longest key that covers the file wins).
- A module imports only modules of its own room and of the rooms its room lists.
  Every import counts: at module level, inside a function, under ``TYPE_CHECKING``.
- A module marked ``never`` in `TORCH_FREE` imports no torch, at import or on call,
  and imports only cadence modules that are ``never`` too; one marked ``on call``
  loads no torch when imported (its functions may), and imports at module level only
  modules that are ``never`` or ``on call``. The packages above an imported module
  run first, so they must be ``never`` or ``on call`` too.
- Only the modules in `DIST_USERS` use ``torch.distributed``, and only the parts of
  it listed there: its process-group API (``torch.distributed``: groups,
  collectives, ranks) or one of torch's features under that namespace (DTensor,
  DeviceMesh, FSDP2, DCP, torch pipelining, Join). Reaching it as an attribute
  (``torch.distributed.get_rank()``) counts as using it.
- A failure names the importing file, the imported module and the two ways out:
  route the import through what the room may use, or change the table here AND the
  same table in ``docs/architecture.md``.
- Every allowance is used by some module (the table says what is, not what might
  be), and ``docs/architecture.md`` shows the same three tables.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import pytest

from tests._source_tree import ROOT, Import, dist_namespace, imports, module_path, modules, owner

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free

DOC = ROOT / "docs" / "architecture.md"
TABLE = "tests/test_allowed_imports.py"

# [Note: the allowed-imports table]
# Keys and entries are paths under src/cadence: a file ("comm.py") or a folder
# ("pickling/", every file below it). A module may import its own room and the
# rooms listed for it, nothing else. The arrows point down the layers drawn in
# docs/architecture.md: the foundation (errors, comm, topology, timing) knows
# nothing above it; the wrappers and the pipeline runtime share only the
# foundation; train/, bench/ and cli.py sit on top and nothing imports them.
_FOUNDATION_FOR_WRAPPERS = {
    "errors.py",
    "_grad_timing/",  # the timing verbs, placeholder grads, autograd hooks, part steppers
    "_modules/",  # the nn.Module conversions both wrappers intercept
    "_groups/exchange.py",  # check_algorithms: the wrappers validate set_collective_algorithms
    "comm.py",
    "_groups/dp_layout.py",  # what group= means (topology.py only through it)
}

ROOMS: dict[str, set[str]] = {
    # The public package: lazy names (see _util/lazy.py), eager only for errors and launch.
    "__init__.py": {
        "_util/",
        "errors.py",
        "launch.py",
        "_groups/dist_init.py",
        "_grad_timing/",
        "comm.py",
        "topology.py",
        "testing.py",
        "data_parallel/",
        "fsdp/",
        "pickling/",
        "pipeline/__init__.py",
        "precompiling/",
    },
    "__main__.py": {"cli.py"},
    "cli.py": {"errors.py", "launch.py", "bench/", "link/", "pipeline/schedule/", "train/"},
    # Foundation: the public faces (errors, comm, topology, launch, testing) and four
    # private rooms below them (see "Rooms of the foundation" in docs/architecture.md).
    "errors.py": set(),
    "_util/": {"errors.py"},  # lazy names, owned paths, the job secret
    "_groups/": {"errors.py", "topology.py"},  # init, group= meaning, exchange, event log
    "comm.py": {"errors.py", "_groups/exchange.py", "_groups/event_log.py"},
    "_grad_timing/": {"errors.py", "comm.py"},
    "_modules/": set(),
    "topology.py": {"errors.py"},
    "launch.py": {"errors.py", "_util/", "pickling/", "_warm.py"},
    "_worker.py": {"__init__.py"},  # cadence.init() in a launched rank
    "_warm.py": {"errors.py"},  # starts _fork_server.py by its command line
    "_fork_server.py": set(),  # preloads and runs the worker by name (importlib, runpy)
    "testing.py": {"errors.py", "launch.py"},
    # Rooms.
    "pickling/": {"errors.py"},
    "link/": {"errors.py"},
    "pipeline/__init__.py": {"_util/", "pipeline/schedule/", "pipeline/runtime/"},
    "pipeline/schedule/": {"errors.py"},
    "pipeline/runtime/": {
        "errors.py",
        "_grad_timing/",  # the verbs; torch_timing: stages may be torch's DDP / FSDP2
        "comm.py",
        "topology.py",
        "pipeline/schedule/",
    },
    # torch's pipelining API, on cadence's schedule layer and runtime.
    "pipelining/": {"pipeline/schedule/", "pipeline/runtime/"},
    # The wrappers never import each other: what they share is in the foundation.
    "data_parallel/": _FOUNDATION_FOR_WRAPPERS,
    "fsdp/": _FOUNDATION_FOR_WRAPPERS,
    "precompiling/": {
        "errors.py",
        "_util/",
        "comm.py",
        "topology.py",
        "pickling/",
        "fsdp/_trace.py",  # a fully_shard unit as its forward sees it, while compiling
    },
    "models/": {"errors.py", "_util/"},
    "train/": {
        "errors.py",
        "_util/",
        "_grad_timing/",  # GradientTiming: the verbs the loop calls on either wrapper
        "_groups/dist_init.py",
        "_groups/missing.py",  # which rank stopped answering, when a collective times out
        "launch.py",
        "comm.py",
        "topology.py",
        "data_parallel/",
        "fsdp/",
        "models/",
        "pipeline/schedule/",
        "pipeline/runtime/",
        "precompiling/",
    },
    # DataParallel under torchft's quorum (the optional ft extra): on top, like train/.
    "ft.py": {"errors.py", "data_parallel/"},
    "bench/": {
        "errors.py",
        "launch.py",
        "link/",  # --link: the ranks on an emulated link, its bytes counted
        "comm.py",
        "topology.py",
        "data_parallel/",
        "fsdp/",
        "models/",
        "pickling/",
        "pipeline/schedule/",
        "pipeline/runtime/",
        "precompiling/",
    },
}

NEVER, ON_CALL = "never", "on call"

# Where torch may not be imported. Unlisted files may import torch.
TORCH_FREE: dict[str, str] = {
    "__init__.py": ON_CALL,  # ``import cadence`` loads no torch; its names load what they need
    "__main__.py": ON_CALL,
    "cli.py": ON_CALL,  # the whole parser builds without torch
    "errors.py": NEVER,
    "_util/": NEVER,
    "launch.py": NEVER,  # imported eagerly by cadence/__init__.py
    "_warm.py": NEVER,  # the launcher's side; the fork server imports torch
    "pickling/": NEVER,
    "link/": NEVER,  # namespaces and tc: plain Linux plumbing
    "pipeline/__init__.py": ON_CALL,
    "pipeline/schedule/": NEVER,  # schedules are planned on machines without torch
    "pipeline/schedule/__init__.py": ON_CALL,  # imports compare.py
    "pipeline/schedule/compare.py": ON_CALL,  # torch's schedule lists, read when called
    "models/__init__.py": ON_CALL,
    "models/config.py": NEVER,
    "train/__init__.py": ON_CALL,
    "train/config.py": NEVER,  # a config is validated before any rank (or torch) starts
    "train/_errors.py": NEVER,  # raised by the torch-free config, data and preflight
    "train/_rules.py": NEVER,
    "train/preflight.py": NEVER,
    "train/placement.py": NEVER,  # pure arithmetic on the layout; tested without a world
    "train/data/__init__.py": NEVER,
    "train/data/stream.py": NEVER,  # --data is read and checked before any rank starts
    "train/data/shards.py": NEVER,
    "train/data/text.py": NEVER,
    "train/data/corpus.py": NEVER,
    "bench/__init__.py": ON_CALL,  # ``cadence bench`` parses and lists kinds without torch
    "bench/_run.py": ON_CALL,
    "bench/_record.py": ON_CALL,
    "bench/report.py": ON_CALL,
}

DIST = "torch.distributed"  # the process-group API itself
DTENSOR, MESH, FSDP2 = f"{DIST}.tensor", f"{DIST}.device_mesh", f"{DIST}.fsdp"
DCP, PIPELINING, JOIN = f"{DIST}.checkpoint", f"{DIST}.pipelining", f"{DIST}.algorithms"

# [Note: who calls torch.distributed]
# Collectives and point-to-point messages of the training path go through comm.py
# (and its _groups/exchange.py). The process-group API is also used, directly, for what
# Comm does not do: starting the job, creating groups, asking a group for ranks,
# and a few object collectives of the trainer around its loop. Each entry says why.
DIST_USERS: dict[str, tuple[set[str], str]] = {
    "comm.py": ({DIST}, "the collective adapter: collectives and point-to-point messages"),
    "_groups/exchange.py": (
        {DIST},
        "Comm's exchange collectives: messages posted from its threads",
    ),
    "_groups/dist_init.py": ({DIST}, "cadence.init: init_process_group and its rendezvous store"),
    "_groups/missing.py": ({DIST}, "the store, asked which rank stopped answering"),
    "topology.py": ({DIST, MESH}, "creates the parallel axes' groups and mesh"),
    "_groups/dp_layout.py": (
        {DIST, MESH, DTENSOR},
        "group= as groups and a mesh; DTensor placements",
    ),
    "_worker.py": ({DIST}, "a launched rank destroys its default group at the end"),
    "_grad_timing/pending_grad.py": ({DTENSOR}, "placeholder gradients of DTensor parameters"),
    "_grad_timing/torch_timing.py": ({FSDP2}, "recognises torch's FSDP2 modules"),
    "data_parallel/_wrapper.py": ({DIST, MESH}, "ProcessGroup and DeviceMesh as group= types"),
    "data_parallel/_join.py": ({DIST, JOIN}, "torch's Join protocol; ProcessGroup type"),
    "data_parallel/_ddp_args.py": ({DIST, MESH}, "DDP's process_group / device_mesh types"),
    "data_parallel/comm_hooks.py": ({DIST}, "a hook's annotation checked against GradBucket"),
    "fsdp/": ({DTENSOR, MESH, FSDP2}, "DTensor parameters on a mesh; FSDP2's policy types"),
    "fsdp/_unit.py": ({DIST}, "this rank's index in the shard group"),
    "pipeline/schedule/compare.py": ({PIPELINING}, "torch's schedule lists, when called"),
    "pipeline/runtime/build.py": ({DIST, PIPELINING}, "rank and size; torch's lowered lists"),
    "pipeline/runtime/executor.py": ({DIST}, "rank and size, to place this rank's stages"),
    "pipeline/runtime/groups.py": ({DIST}, "creates one communicator per channel"),
    "pipeline/runtime/tied.py": ({DIST}, "creates the groups that hold a tied parameter"),
    "pipelining/": ({DIST, PIPELINING}, "torch's stages, tracer, chunk specs; a stage's group"),
    "precompiling/_api.py": ({DIST}, "works with or without a process group"),
    "precompiling/_share.py": ({DIST}, "the default group when there is one"),
    "train/": ({DCP}, "checkpoints through DCP"),
    "train/run.py": ({DIST}, "destroys the group it created"),
    "train/checkpoint.py": ({DIST}, "a gloo group for async saves; rank 0's verdict"),
    "train/clip.py": ({DTENSOR}, "the local shard of a fully_shard gradient"),
    "train/export.py": ({DTENSOR}, "a fully_shard parameter gathered for --export"),
    "bench/": ({DIST, MESH, FSDP2, PIPELINING}, "times torch's own DDP, FSDP2, pipelining"),
}


# ---------------------------------------------------------------------------
# The checks, on a tree given as {path: imports}, so a test can add a bad import
# ---------------------------------------------------------------------------

Tree = Mapping[str, Sequence[Import]]


def _covers(key: str, path: str) -> bool:
    return path == key or (key.endswith("/") and path.startswith(key))


def _lookup(table: Mapping[str, object], path: str) -> str | None:
    """The longest key of ``table`` that covers ``path``."""
    keys = [k for k in table if _covers(k, path)]
    return max(keys, key=len) if keys else None


def _real_tree() -> dict[str, tuple[Import, ...]]:
    return {module_path(m): imports(m) for m in modules()}


def _target_path(target: str) -> str | None:
    mod = owner(target) if target == "cadence" or target.startswith("cadence.") else None
    return module_path(mod) if mod else None


def _cadence_edges(
    tree: Tree, path: str, keep: Callable[[Import], bool] = lambda i: True
) -> list[tuple[str, Import]]:
    out = []
    for imp in tree[path]:
        target = _target_path(imp.target)
        if target is not None and target != path and keep(imp):
            out.append((target, imp))
    return out


def _way_out(table: str) -> str:
    return f"or change {table} in {TABLE} AND the same table in docs/architecture.md"


def room_violations(tree: Tree) -> list[str]:
    out = []
    for path in sorted(tree):
        room = _lookup(ROOMS, path)
        if room is None:
            out.append(
                f"{path} is in no room: add it to ROOMS in {TABLE} and to docs/architecture.md"
            )
            continue
        for target, imp in _cadence_edges(tree, path):
            if _covers(room, target) or _lookup(ROOMS, target) == room:
                continue
            if any(_covers(a, target) for a in ROOMS[room]):
                continue
            allowed = ", ".join(sorted(ROOMS[room])) or "nothing outside itself"
            out.append(
                f"{path}:{imp.line} imports {imp.target} ({target}), which room {room} may "
                f"not import. Route it through what {room} may import ({allowed}), "
                + _way_out(f"ROOMS[{room!r}]")
            )
    return out


def _torch_level(path: str) -> str | None:
    key = _lookup(TORCH_FREE, path)
    return TORCH_FREE[key] if key else None


def torch_violations(tree: Tree) -> list[str]:
    out = []
    for path in sorted(tree):
        level = _torch_level(path)
        if level is None:
            continue
        runs = (lambda i: not i.type_only) if level == NEVER else (lambda i: i.at_import)
        for imp in tree[path]:
            if imp.attribute or not runs(imp):
                continue
            if imp.target == "torch" or imp.target.startswith("torch."):
                when = "at all" if level == NEVER else "when imported"
                out.append(
                    f"{path}:{imp.line} imports {imp.target}, but {path} may not import torch "
                    f"{when} (TORCH_FREE: {level}). Import it inside the function that needs it, "
                    "in a module that may, " + _way_out("TORCH_FREE")
                )
        ok = {NEVER} if level == NEVER else {NEVER, ON_CALL}
        for target, imp in _cadence_edges(tree, path, runs):
            # Importing a module first runs every package above it.
            needs = [(target, ok)] + [(p, {NEVER, ON_CALL}) for p in _packages_above(target)]
            for module, allowed in needs:
                if _torch_level(module) in allowed:
                    continue
                out.append(
                    f"{path}:{imp.line} imports {imp.target} ({module}), which may import "
                    f"torch, but {path} is torch-free ({level}). Import it inside the function "
                    f"that needs it, declare {module} torch-free if it is, "
                    + _way_out("TORCH_FREE")
                )
    return out


def _packages_above(path: str) -> list[str]:
    """``pipeline/schedule/ir.py`` -> ``__init__.py``, ``pipeline/__init__.py``, ..."""
    folders = path.split("/")[:-1]
    return [
        "/".join([*folders[:n], "__init__.py"])
        for n in range(len(folders) + 1)
        if "/".join([*folders[:n], "__init__.py"]) != path
    ]


def _dist_allowed(path: str) -> set[str]:
    return {ns for key, (names, _) in DIST_USERS.items() if _covers(key, path) for ns in names}


def dist_violations(tree: Tree) -> list[str]:
    out = []
    for path in sorted(tree):
        allowed = _dist_allowed(path)
        for imp in tree[path]:
            namespace = dist_namespace(imp.target)
            if namespace is None or namespace in allowed:
                continue
            route = (
                "Go through cadence.comm.Comm (collectives, messages, object collectives) or "
                "topology.ParallelGroups (groups, ranks)"
                if namespace == DIST
                else f"Use {namespace} only where it is listed"
            )
            out.append(
                f"{path}:{imp.line} uses {imp.target} ({namespace}), which {path} may not use. "
                f"{route}, " + _way_out("DIST_USERS (with the reason)")
            )
    return out


# ---------------------------------------------------------------------------
# The source tree against the tables
# ---------------------------------------------------------------------------


def test_every_module_is_in_a_room_and_imports_only_what_the_room_may() -> None:
    bad = room_violations(_real_tree())
    assert not bad, "\n".join(bad)


def test_torch_free_modules_do_not_import_torch() -> None:
    bad = torch_violations(_real_tree())
    assert not bad, "\n".join(bad)


def test_only_the_listed_modules_use_torch_distributed() -> None:
    bad = dist_violations(_real_tree())
    assert not bad, "\n".join(bad)


def test_every_allowance_is_used() -> None:
    tree = _real_tree()
    unused = []
    for room, allowed in ROOMS.items():
        members = [p for p in tree if _lookup(ROOMS, p) == room]
        if not members:
            unused.append(f"ROOMS[{room!r}]: no module")
        for entry in sorted(allowed):
            if not any(_covers(entry, t) for p in members for t, _ in _cadence_edges(tree, p)):
                unused.append(f"ROOMS[{room!r}] allows {entry}")
    for key, (names, _) in DIST_USERS.items():
        members = [p for p in tree if _covers(key, p)]
        for ns in sorted(names):
            if not any(dist_namespace(i.target) == ns for p in members for i in tree[p]):
                unused.append(f"DIST_USERS[{key!r}] allows {ns}")
    for key in TORCH_FREE:
        if not any(_covers(key, p) for p in tree):
            unused.append(f"TORCH_FREE[{key!r}]: no module")
    assert not unused, (
        "the table allows what no module does; remove it here and from docs/architecture.md: "
        + "; ".join(unused)
    )


# ---------------------------------------------------------------------------
# A forbidden import fails, and says what to do
# ---------------------------------------------------------------------------


def _added(
    check: Callable[[Tree], list[str]],
    path: str,
    target: str,
    *,
    at_import: bool = True,
    type_only: bool = False,
) -> list[str]:
    """What ``check`` reports once ``path`` also imports ``target``, beyond the real tree's."""
    tree = _real_tree()
    before = set(check(tree))
    tree[path] = (*tree[path], Import(target, 999, at_import, type_only))
    return [m for m in check(tree) if m not in before]


@pytest.mark.parametrize(
    ("at_import", "type_only"),
    [(True, False), (False, False), (False, True)],
    ids=["module level", "in a function", "under TYPE_CHECKING"],
)
def test_an_import_outside_the_table_is_named_with_the_way_out(
    at_import: bool, type_only: bool
) -> None:
    [message] = _added(
        room_violations,
        "pipeline/schedule/ir.py",
        "cadence.comm",
        at_import=at_import,
        type_only=type_only,
    )
    assert message.startswith("pipeline/schedule/ir.py:999 imports cadence.comm (comm.py)")
    assert "room pipeline/schedule/" in message and "(errors.py)" in message
    assert f"ROOMS['pipeline/schedule/'] in {TABLE} AND" in message
    assert "docs/architecture.md" in message


def test_a_module_outside_every_room_is_named() -> None:
    tree = {**_real_tree(), "newroom/thing.py": ()}
    assert (
        f"newroom/thing.py is in no room: add it to ROOMS in {TABLE} and to docs/architecture.md"
        in room_violations(tree)
    )


def test_torch_in_a_torch_free_module_is_named() -> None:
    [message] = _added(torch_violations, "pickling/_state.py", "torch", at_import=False)
    assert message.startswith("pickling/_state.py:999 imports torch")
    assert "may not import torch at all (TORCH_FREE: never)" in message
    # A torch-free-at-import module may import torch inside a function, not at the top.
    assert _added(torch_violations, "cli.py", "torch", at_import=False) == []
    [message] = _added(torch_violations, "cli.py", "torch.nn")
    assert "when imported (TORCH_FREE: on call)" in message
    [message] = _added(torch_violations, "train/config.py", "cadence.comm")
    assert "train/config.py:999 imports cadence.comm (comm.py), which may import torch" in message
    # Importing a module runs the packages above it: a torch-free module may import a
    # torch-free module only under packages that load no torch when imported.
    assert _packages_above("pipeline/schedule/ir.py") == [
        "__init__.py",
        "pipeline/__init__.py",
        "pipeline/schedule/__init__.py",
    ]
    assert _packages_above("pipeline/__init__.py") == ["__init__.py"]


def test_torch_distributed_outside_the_list_is_named() -> None:
    [message] = _added(dist_violations, "train/loop.py", "torch.distributed", at_import=False)
    assert message.startswith("train/loop.py:999 uses torch.distributed (torch.distributed)")
    assert "Go through cadence.comm.Comm" in message and "DIST_USERS" in message
    [message] = _added(dist_violations, "comm.py", "torch.distributed.tensor")
    assert "uses torch.distributed.tensor (torch.distributed.tensor)" in message


# ---------------------------------------------------------------------------
# docs/architecture.md shows the same tables
# ---------------------------------------------------------------------------

_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*?)\|(.*)$")


def _doc_table(heading: str) -> dict[str, tuple[set[str], str]]:
    """The rows of the first table under ``heading``: key -> (backticked names, rest)."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    assert heading in lines, f"docs/architecture.md has no {heading!r} section"
    rows: dict[str, tuple[set[str], str]] = {}
    started = False
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        match = _ROW.match(line)
        if match:
            started = True
            rows[match[1]] = (set(re.findall(r"`([^`]+)`", match[2])), match[2].strip())
        elif started and not line.startswith("|"):
            break
    return rows


def _mismatch(doc: Mapping[str, object], test: Mapping[str, object]) -> list[str]:
    return [
        f"{k}: docs {doc.get(k)!r}, test {test.get(k)!r}"
        for k in sorted(set(doc) | set(test))
        if doc.get(k) != test.get(k)
    ]


def test_the_doc_shows_the_rooms_table() -> None:
    doc = {k: names for k, (names, _) in _doc_table("## Allowed imports").items()}
    diff = _mismatch(doc, {k: set(v) for k, v in ROOMS.items()})
    assert not diff, "docs/architecture.md's allowed imports differ:\n" + "\n".join(diff)


def test_the_doc_shows_the_torch_free_table() -> None:
    doc = {k: text for k, (_, text) in _doc_table("## torch-free modules").items()}
    diff = _mismatch(doc, TORCH_FREE)
    assert not diff, "docs/architecture.md's torch-free table differs:\n" + "\n".join(diff)


def test_the_doc_shows_who_uses_torch_distributed() -> None:
    doc = {k: names for k, (names, _) in _doc_table("## Who calls torch.distributed").items()}
    diff = _mismatch(doc, {k: set(names) for k, (names, _) in DIST_USERS.items()})
    assert not diff, "docs/architecture.md's torch.distributed list differs:\n" + "\n".join(diff)
