"""What a run shows and keeps: the progress display, the summary table, ``metrics.json``.

Rank 0 reports. The summary is a plain dict (JSON-ready); ``metrics.json`` holds
the config, the summary, every step's loss and rank 0's collective counts.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cadence.train.config import Layout, TrainConfig
from cadence.train.config_file import config_to_toml
from cadence.train.metrics import attention_shape, flops_per_token, mfu

__all__ = ["Progress", "print_samples", "print_table", "summarize", "write_config", "write_metrics"]


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, one plain log line per tenth of the
    run otherwise (a log file or CI gets no carriage returns or bar redraws).

    ``start`` is the step a resumed run continues from: the bar starts there.
    """

    def __init__(self, total: int, start: int = 0, *, tty: bool | None = None) -> None:
        self.total = total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.started = time.perf_counter()
        self.start = start
        self._bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        if done % max(1, self.total // 10) and done != self.total:
            return
        rate = (done - self.start) / max(time.perf_counter() - self.started, 1e-9)
        print(
            f"step {done}/{self.total}  loss {loss:.4f}  {rate:.1f} steps/s",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def summarize(cfg: TrainConfig, layout: Layout, result: dict[str, Any]) -> dict[str, Any]:
    """The summary table's values (also ``metrics.json["summary"]``)."""
    losses = result["losses"]
    tokens_per_step = cfg.batch_size * cfg.model.seq_len
    step_s = result["step_time_median_s"]
    mode = "pipeline" if layout.pp > 1 else layout.wrapper
    evals = result.get("evals") or []
    tokens_per_s = tokens_per_step / step_s if step_s > 0 else float("nan")
    # See [Note: FLOPs per token and MFU] in cadence.train.metrics.
    n_params = result.get("flop_params", 0)
    shape = attention_shape(cfg)
    if shape is None:
        per_token = flops_per_token(n_params, 0, 0, cfg.model.seq_len)
        formula = f"6N, N={n_params:,}; attention not counted: --model does not give L and d"
    else:
        (layers, width), seq = shape, cfg.model.seq_len
        per_token = flops_per_token(n_params, layers, width, seq)
        formula = f"6N + 12LdT, N={n_params:,}, L={layers}, d={width}, T={seq}"
    utilization, mfu_note = mfu(tokens_per_s, per_token, cfg.peak_flops, layout.world)
    memory = result.get("peak_memory_bytes") or []
    return {
        "mode": mode,
        "wrapper": layout.wrapper,
        "world_size": layout.world,
        "finalize": cfg.finalize if layout.pp == 1 else "schedule",
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tokens_per_s": tokens_per_s,
        "flop_params": n_params,
        "flops_per_token": per_token,
        "flops_per_token_formula": formula,
        "mfu": utilization,
        "mfu_note": mfu_note,
        "peak_memory_mib_per_rank": [round(b / 2**20, 1) for b in memory],
        "peak_memory_kind": result.get("peak_memory_kind", ""),
        "step_time_median_ms": step_s * 1e3,
        "comm_exposed_ms_total": result["comm_exposed_s"] * 1e3,
        "comm_hidden_ms_total": result["comm_hidden_s"] * 1e3,
        # The held-out loss of the last evaluation (--eval-every); None without.
        "last_eval_loss": evals[-1][1] if evals else None,
    }


def _ms(value: float) -> str:
    # NaN: nothing to report (a pipeline without data-parallel stages has no
    # reductions; its P2P time is not split into exposed and hidden).
    return "n/a" if value != value else f"{value:.1f} ms"


def _mfu(summary: dict[str, Any]) -> str:
    if summary["mfu"] is None:
        return str(summary["mfu_note"])
    return f"{summary['mfu']:.2%} ({summary['mfu_note']})"


def _memory(summary: dict[str, Any]) -> str:
    per_rank = summary["peak_memory_mib_per_rank"]
    if not per_rank:
        return "n/a"
    return f"max {max(per_rank):.0f} MiB over {len(per_rank)} ranks ({summary['peak_memory_kind']})"


def print_samples(text: str) -> None:
    """The generated samples, on stdout: the command's output, like the table."""
    print(text, end="")


def print_table(
    summary: dict[str, Any], run_dir: Path, precompile: list[dict[str, Any]] | None = None
) -> None:
    """The summary table; with ``--compile``, each rank's precompile source and seconds."""
    rows = [
        ("mode", summary["mode"]),
        ("wrapper", summary["wrapper"]),
        ("ranks", summary["world_size"]),
        ("finalize", summary["finalize"]),
        ("steps", summary["steps"]),
        ("first loss", f"{summary['first_loss']:.4f}"),
        ("last loss", f"{summary['last_loss']:.4f}"),
        *(
            [("held-out loss", f"{summary['last_eval_loss']:.4f}")]
            if summary.get("last_eval_loss") is not None
            else []
        ),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
        (
            "FLOPs/token",
            f"{summary['flops_per_token']:.3g} ({summary['flops_per_token_formula']})",
        ),
        ("MFU", _mfu(summary)),
        ("peak memory", _memory(summary)),
        ("median step", f"{summary['step_time_median_ms']:.1f} ms"),
        ("comm exposed (total)", _ms(summary["comm_exposed_ms_total"])),
        ("comm hidden (total)", _ms(summary["comm_hidden_ms_total"])),
        ("run folder", str(run_dir)),
    ]
    for rank, p in enumerate(precompile or []):
        rows.insert(
            -1,
            (
                f"precompile rank {rank}",
                f"{p['source']}  compile {p['compile_s']:.2f} s  load {p['load_s']:.2f} s  "
                f"wait {p['wait_s']:.2f} s",
            ),
        )
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    print(line)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(line)


def write_metrics(
    cfg: TrainConfig, summary: dict[str, Any], result: dict[str, Any], run_dir: Path
) -> Path:
    """``run_dir/metrics.json``: config, summary, every step's loss (from step 1, across
    restarts), the held-out losses, the steps checkpointed and resumed from,
    collectives, pipeline facts,
    and what the timeline picture keeps of each rank (``timeline_bounds``)."""
    metrics = {
        "config": asdict(cfg),
        "summary": summary,
        "losses": result["losses"],
        "checkpoints": result["history"].checkpoints,
        "resumes": result["history"].resumes,
        # [step, loss] of each evaluation on the held-out tokens (--eval-every).
        "evals": [list(e) for e in result["history"].evals],
        "collectives_rank0": result["collectives"],
    }
    for key in ("pipeline", "precompile", "timeline_bounds"):
        if key in result:
            metrics[key] = result[key]
    path = run_dir / "metrics.json"
    path.write_text(json.dumps(metrics, indent=2))
    return path


def write_config(cfg: TrainConfig, run_dir: Path) -> Path:
    """``run_dir/config.toml``: the resolved options (``--config`` takes it back)."""
    path = run_dir / "config.toml"
    path.write_text(config_to_toml(cfg), encoding="utf-8")  # TOML is UTF-8, whatever the locale
    return path
