"""``cadence bench scale``: what grows with the problem, on log-log axes with fitted slopes.

Four quantities, each against the size that should drive it, in one process tree:

- **schedule build and proof time against p·m**: `cadence.bench.schedules` measures
  them (this module calls its `schedules.measure_cadence` and `schedules.measure_torch`
  for a few generators at its sizes, torch's construction beside cadence's build);
- **setup bytes per rank against world size** (2, 4, 8 real gloo ranks): what a
  pipeline build (plan vote and preconnect), fully_shard's construction and
  DataParallel's construction send and receive, counted through each one's
  `EventLog` as the setup-bytes tests count them; torch has no equivalent log
  (DDP's and FSDP2's set-up collectives run in C++), so this panel is cadence's alone;
- **fully_shard and FSDP2 init time and per-rank parameter bytes against world size**
  (64, 1024, 8192), as rank 0 of torch's fake process group;
- **DataParallel and DDP** likewise. DDP's constructor runs on the fake group, its
  backward does not (the fake all-reduce's future carries no tensor, which DDP's
  reducer asserts on), so only construction is measured, on both sides.

[Note: schedule figures are measured here, not read from a schedules record]
Reading the newest ``schedules`` record would tie this record to a file that may be
missing, stale, or from another machine and torch, and the panels of one chart would
then come from different machines at different moments. Measuring again costs a few
minutes at most (three generators, under the per-size cap of ``cadence bench
schedules``), and the record stays self-contained; the measurement code itself lives in one place,
`cadence.bench.schedules`.

[Note: a fresh process per fake world]
torch's fake backend (``torch.testing._internal.distributed.fake_pg``) accepts any
rank and world size and completes every collective at once without moving data, so
one process builds a wrapper exactly as rank 0 of ``W`` would: every shard, buffer
and hook of that world. Each world runs in a fresh spawned process (torch's DTensor
and mesh caches outlive a destroyed group), which first builds each wrapper once
uncounted, then times ``reps`` builds of each, interleaved with the order rotated
(see [Note: interleaving] in ``_loop.py``). The model is a stack of Linear(64, 8192 x
2) layers: every parameter's rows divide by every world, so sharded bytes are exactly
1/world and a slope of -1.0 is the ideal; a flat line (0.0) is the ideal for
replicated bytes and for init time.

Slopes are least-squares fits of log(y) over log(x) (`schedules.slope`).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from cadence.bench import schedules
from cadence.bench._loop import launch_ranks, loadavg
from cadence.bench._record import make_record, paired_ratios, ratio_summary

__all__ = ["fake_world_body", "run", "setup_bytes_body", "write_chart"]

# Generators torch also builds (its 1F1B and GPipe lowerings refuse fake stages).
GENERATORS = ("interleaved", "zb_h1", "zbv")
SETUP_WORLDS = (2, 4, 8)
FAKE_WORLDS = (64, 1024, 8192)
FULL = {"layers": 8, "width": 64, "rows": 2 * 8192, "reps": 5}
QUICK = {"layers": 8, "width": 64, "rows": 2 * 8192, "reps": 3}
TINY = {"layers": 2, "width": 8, "rows": 64, "reps": 1}
TINY_FAKE_WORLDS = (8, 64)
TINY_SETUP_WORLDS = (2,)
# (variant, implementation): a second torch build is the A/A noise figure.
FSDP_VARIANTS = (("cadence", "fully_shard"), ("torch", "fsdp2"), ("torch_b", "fsdp2"))
DP_VARIANTS = (("cadence", "data_parallel"), ("torch", "ddp"), ("torch_b", "ddp"))


def _model(sizes: dict[str, int]) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Linear(sizes["width"], sizes["rows"]) for _ in range(sizes["layers"]))
    )


def _wrap(impl: str, sizes: dict[str, int]) -> Any:
    """A fresh model wrapped by ``impl`` in the current (fake) world."""
    net = _model(sizes)
    if impl == "fully_shard":
        from cadence.fsdp import fully_shard

        for layer in net:
            fully_shard(layer)
        return fully_shard(net)
    if impl == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            torch_fully_shard(layer, mesh=mesh)
        return torch_fully_shard(net, mesh=mesh)
    if impl == "data_parallel":
        from cadence.data_parallel import DataParallel

        return DataParallel(net)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(net)


def _param_bytes(net: Any) -> int:
    """Bytes of the distinct storages behind this rank's parameters (DTensors: the
    local shard's; cadence's shards are views of one flat shard per unit)."""
    seen: dict[int, int] = {}
    for p in net.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def fake_world_body(world: int, sizes: dict[str, int]) -> dict[str, Any]:
    """Rank 0 of a fake world: init seconds per repetition and parameter bytes per
    variant (see [Note: a fresh process per fake world])."""
    import torch
    import torch.distributed as dist

    # Importing the module registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        out: dict[str, Any] = {}
        for label, variants in (("fsdp", FSDP_VARIANTS), ("dp", DP_VARIANTS)):
            impls = dict(variants)
            times: dict[str, list[float]] = {name: [] for name in impls}
            nbytes = {name: _param_bytes(_wrap(impl, sizes)) for name, impl in impls.items()}
            names = list(impls)
            for rep in range(sizes["reps"]):
                k = rep % len(names)
                for name in names[k:] + names[:k]:
                    t0 = time.perf_counter()
                    net = _wrap(impls[name], sizes)
                    times[name].append(time.perf_counter() - t0)
                    del net
            out[label] = {"times": times, "bytes": nbytes}
        return out
    finally:
        dist.destroy_process_group()


def _fake_worlds(worlds: tuple[int, ...], sizes: dict[str, int]) -> dict[int, dict[str, Any]]:
    spawn = multiprocessing.get_context("spawn")
    out = {}
    for world in worlds:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            out[world] = pool.submit(fake_world_body, world, sizes).result(timeout=1800)
    return out


def setup_bytes_body() -> dict[str, int]:
    """Bytes this rank's collectives moved while each set-up step ran (each event's
    buffer: what a rank sends, or receives into), as tests/train/test_setup_bytes.py."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from cadence.comm import EventLog
    from cadence.data_parallel import DataParallel
    from cadence.fsdp import fully_shard
    from cadence.pipeline.runtime import build_pipeline

    def total(log: EventLog) -> int:
        return sum(e.nbytes for e in log.collectives())

    def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((y - target) ** 2).mean()

    torch.manual_seed(0)
    world = dist.get_world_size()
    out: dict[str, int] = {}
    log = EventLog()
    stages = [nn.Linear(4, 4) for _ in range(world)]
    build_pipeline("gpipe", stages, n_microbatches=2, loss_fn=loss, event_log=log)
    out["pipeline build"] = total(log)
    log = EventLog()
    fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), event_log=log)
    out["fully_shard init"] = total(log)
    log = EventLog()
    DataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), event_log=log)
    out["DataParallel init"] = total(log)
    return out


def _schedule_series(
    sizes: list[tuple[int, int]], generators: tuple[str, ...], cap_s: float
) -> tuple[dict[str, list[list[float]]], list[dict[str, Any]], list[str]]:
    """Build, proof and torch-build seconds against p·m, with the schedules bench's cap."""
    series: dict[str, list[list[float]]] = {}
    rows: list[dict[str, Any]] = []
    capped: list[str] = []
    for name in generators:
        last_c = last_t = 0.0
        for p, m in sizes:
            if last_c * schedules.GROWTH > cap_s:
                capped.append(f"{name} p={p} m={m}")
                continue
            c = schedules.measure_cadence(name, p, m)
            last_c = c["build"] + c["proof"]
            series.setdefault(f"{name} build", []).append([p * m, c["build"]])
            series.setdefault(f"{name} proof", []).append([p * m, c["proof"]])
            t: dict[str, float] | str = f"skipped: projected over {cap_s:.0f} s"
            if last_t * schedules.GROWTH <= cap_s:
                t = schedules.measure_torch(name, p, m)
            ratio = None
            extra: dict[str, Any] = {"build_s": c["build"], "proof_s": c["proof"]}
            if isinstance(t, dict):
                last_t = t["build"]
                series.setdefault(f"{name} torch build", []).append([p * m, t["build"]])
                ratio = ratio_summary([c["build"] / t["build"]])
                extra["torch_build_s"] = t["build"]
            else:
                extra["torch"] = t
            rows.append(
                {"case": f"{name} p·m={p * m} (p={p})", "metric": "schedule build vs torch",
                 "ratio": ratio, "aa": None, "target": None, "extra": extra}
            )  # fmt: skip
    return series, rows, capped


def _wrapper_rows(
    fake: dict[int, dict[str, Any]], label: str, mine: str, theirs: str
) -> tuple[list[dict[str, Any]], dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Init time and parameter-bytes rows of one comparison, and their series."""
    rows: list[dict[str, Any]] = []
    times: dict[str, list[list[float]]] = {mine: [], theirs: []}
    nbytes: dict[str, list[list[float]]] = {mine: [], theirs: []}
    for world, res in fake.items():
        t, b = res[label]["times"], res[label]["bytes"]
        rows.append(
            {"case": f"{mine} world {world}", "metric": f"init time vs {theirs}",
             "ratio": ratio_summary(paired_ratios(t["cadence"], t["torch"])),
             "aa": ratio_summary(paired_ratios(t["torch"], t["torch_b"])), "target": None,
             "abs_ms": {k: 1e3 * statistics.median(v) for k, v in t.items()}}
        )  # fmt: skip
        rows.append(
            {"case": f"{mine} world {world}", "metric": f"parameter bytes per rank vs {theirs}",
             "ratio": ratio_summary([b["cadence"] / b["torch"]]), "aa": None, "target": None,
             "extra": {"cadence_bytes": b["cadence"], "torch_bytes": b["torch"]}}
        )  # fmt: skip
        times[mine].append([world, statistics.median(t["cadence"])])
        times[theirs].append([world, statistics.median(t["torch"])])
        nbytes[mine].append([world, b["cadence"]])
        nbytes[theirs].append([world, b["torch"]])
    return rows, times, nbytes


def run(*, quick: bool, tiny: bool = False, cap_s: float = schedules.CAP_S) -> dict[str, Any]:
    """Measure the four quantities and return one record (not yet written)."""
    from cadence.bench import scale

    sizes = TINY if tiny else QUICK if quick else FULL
    sched_sizes = (
        schedules.TINY_SIZES if tiny else schedules.QUICK_SIZES if quick else schedules.SIZES
    )
    generators = GENERATORS[:1] if tiny else GENERATORS
    setup_worlds = TINY_SETUP_WORLDS if tiny else SETUP_WORLDS
    fake_worlds = TINY_FAKE_WORLDS if tiny else FAKE_WORLDS
    load0 = loadavg()

    sched, rows, capped = _schedule_series(sched_sizes, generators, cap_s)
    setup: dict[str, list[list[float]]] = {}
    for world in setup_worlds:
        per_rank = launch_ranks(scale.setup_bytes_body, world=world, timeout=600)
        for step in per_rank[0]:
            most = max(r[step] for r in per_rank)  # the busiest rank's
            setup.setdefault(step, []).append([world, most])
            rows.append(
                {"case": f"{step} world {world}", "metric": "setup bytes, busiest rank",
                 "ratio": None, "aa": None, "target": None,
                 "extra": {"bytes": most, "torch": "no equivalent log"}}
            )  # fmt: skip
    fake = _fake_worlds(fake_worlds, sizes)
    fsdp_rows, fsdp_times, fsdp_bytes = _wrapper_rows(fake, "fsdp", "fully_shard", "FSDP2")
    dp_rows, dp_times, dp_bytes = _wrapper_rows(fake, "dp", "DataParallel", "DDP")
    rows += fsdp_rows + dp_rows

    series = {
        "schedule build and proof (s) vs p·m": sched,
        "setup bytes per rank vs world (gloo)": setup,
        "init time (s) vs world (fake group)": {**fsdp_times, **dp_times},
        "parameter bytes per rank vs world (fake group)": {**fsdp_bytes, **dp_bytes},
    }
    slopes = {
        panel: {line: schedules.slope([(x, y) for x, y in pts]) for line, pts in lines.items()}
        for panel, lines in series.items()
    }
    record = make_record(
        "scale",
        quick=quick,
        rows=rows,
        load_before=load0,
        settings={
            "schedule sizes": " ".join(f"{p}x{m}" for p, m in sched_sizes),
            "generators": ", ".join(generators),
            "setup worlds": " ".join(map(str, setup_worlds)),
            "fake worlds": " ".join(map(str, fake_worlds)),
            "model": f"{sizes['layers']} x Linear({sizes['width']}, {sizes['rows']})",
            "init repetitions": sizes["reps"],
            "cap_s": cap_s,
            "capped": ", ".join(capped) or "none",
        },
    )
    record["series"] = series
    record["slopes"] = slopes
    return record


def write_chart(record: dict[str, Any], path: Path) -> Path | None:
    """One log-log panel per quantity; each line's legend holds its fitted slope."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series, slopes = record["series"], record["slopes"]
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 5))
    for ax, (panel, lines) in zip(axes, series.items(), strict=True):
        for line, all_pts in lines.items():
            pts = [(x, y) for x, y in all_pts if x > 0 and y > 0]  # log axes: no zeros
            if not pts:  # e.g. a set-up step that sends nothing: said in the legend
                ax.plot([], [], " ", label=f"{line}: 0 at every size")
                continue
            k = slopes[panel][line]
            label = f"{line} (slope {k:.2f})" if k is not None else line
            # torch's lines dashed: where they equal cadence's they must stay visible.
            style = "x--" if line in ("FSDP2", "DDP") or "torch" in line else "o-"
            ax.loglog([x for x, _ in pts], [y for _, y in pts], style, ms=4, label=label)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(panel.rsplit(" vs ", 1)[-1])
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    load = record["machine"]["loadavg"][0]
    fig.suptitle(
        f"cadence bench scale{' --quick' if record['quick'] else ''}: "
        f"{record['machine']['cpu_count']} CPUs, load {load:.1f}, {record['created']} "
        "(slope 0 = flat, -1 = 1/world, 1 = linear)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
