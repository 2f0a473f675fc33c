"""Rank body of the resources test: a step that raises after an asynchronous save."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

import cadence.train.run as run_module
from cadence.models.config import GPTConfig
from cadence.train.checkpoint import Checkpointer
from cadence.train.config import TrainConfig


class StepFailed(RuntimeError):
    pass


def body_a_failing_step(run_dir: str) -> dict[str, Any]:
    """Steps 1-2 run, step 2's asynchronous save is launched, step 3 raises. Returns
    what the error left behind on this rank (checked by the test)."""
    closed: list[bool] = []
    groups_freed: list[bool] = []
    real_close = Checkpointer.close

    def close(self: Checkpointer) -> None:
        real_close(self)
        closed.append(True)
        groups_freed.append(self._group is None)

    real_loop = run_module.run_loop

    def failing_loop(state: Any, steps: int, batch_size: int, on_step: Any, **kw: Any) -> Any:
        def step_then_fail(step: int, loss: float) -> None:
            on_step(step, loss)  # step 2's on_step launches the save
            if step == 1:
                raise StepFailed("step 3 failed")

        return real_loop(state, steps, batch_size, step_then_fail, **kw)

    Checkpointer.close = close  # type: ignore[method-assign]
    run_module.run_loop = failing_loop  # type: ignore[assignment]
    threads_before = {t.ident for t in threading.enumerate()}
    cfg = TrainConfig(
        steps=4,
        batch_size=8,
        nproc=dist.get_world_size(),
        run_dir=run_dir,
        checkpoint_every=2,
        async_checkpoint=True,
        model=GPTConfig(d_model=16, n_layers=2),
    )
    try:
        run_module.run_rank(cfg)
    except StepFailed:
        pass
    else:
        raise AssertionError("the failing step did not raise")
    finally:
        Checkpointer.close = real_close  # type: ignore[method-assign]
        run_module.run_loop = real_loop  # type: ignore[assignment]
    dist.barrier()
    root = Path(run_dir) / "checkpoints"
    return {
        "closed": closed,
        "groups_freed": groups_freed,
        "folders": sorted(p.name for p in root.iterdir()),
        "new_threads": [
            t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()
        ],
    }
