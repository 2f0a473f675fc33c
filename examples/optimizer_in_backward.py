"""Overlap pattern (b): finalize the dense gradients and step their optimizer inside backward.

Run:  python examples/optimizer_in_backward.py [--steps 5]

The same toy model as ``examples/overlap_sparse.py``: a sparse
``nn.EmbeddingBag`` feeding a dense MLP wrapped in `cadence.DataParallel`
(manual finalization). A tensor hook on the embedding output, a tensor of the
sparse path one op upstream of the dense module, fires once the dense tower's
backward is over, i.e. once every wrapped parameter's gradient has been
accumulated and every bucket's all-reduce has launched. The hook then calls
``dp.finalize_backward()`` and the dense ``optimizer.step()``, while the rest of
the backward (the embedding's gradient) is still to run:

    compute: [dense bwd][hook: finalize + dense step][embedding bwd][sparse exchange + step]
    comm:        [AR b0 .. AR bn]

In a real recommender the gap is the embedding all-to-all backward (a sparse
communication bubble); torch DDP cannot do this, because it finalizes in an
engine callback after the whole backward.

A hook that runs earlier (while some bucket has not launched) gets a
``RuntimeError`` saying how many buckets have launched; see the tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import cadence

# The shared model, data and trainer live next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import overlap_sparse as base


class InBackwardTrainer(base.Trainer):
    """Pattern (b): the dense half finishes from a backward hook."""

    def __init__(self, seed: int = 0, lr: float = 0.05) -> None:
        super().__init__(seed, lr)
        self.hook_records: list[dict[str, Any]] = []

    def _dense_finish_hook(self, grad: torch.Tensor) -> None:
        # Runs inside backward: record that (the test checks it), then finalize and step.
        record = {"in_backward": torch._C._current_graph_task_id() != -1}
        self.dp.finalize_backward()
        self.dense_opt.step()
        record["stepped"] = True
        self.log.mark("dense_step_in_backward")
        self.hook_records.append(record)

    def step_in_backward(self, step: int) -> float:
        ids, x, y = self.local_batch(step)
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        out = base.forward(self.bag, self.dp, ids, x, emb_hook=self._dense_finish_hook)
        loss = F.mse_loss(out, y)
        loss.backward()  # the dense params are already updated when this returns
        self.log.mark("backward_end")
        base.average_sparse_grad(self.sparse_comm, self.bag)
        self.sparse_opt.step()
        return loss.item()


def rank_main(steps: int) -> dict[str, Any]:
    trainer = InBackwardTrainer()
    losses = [trainer.step_in_backward(step) for step in range(steps)]
    return {
        "losses": losses,
        "buckets": trainer.dp.num_buckets,
        "hooks_in_backward": sum(r["in_backward"] for r in trainer.hook_records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = cadence.launch(rank_main, args.steps, nprocs=2, backend="gloo", num_threads=1)
    r = results[0]
    print(f"pattern (b): {r['buckets']} dense buckets, {args.steps} steps on 2 gloo ranks")
    print(f"  loss (rank 0): {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    print(
        f"  finalize_backward() + dense optimizer.step() ran inside backward in "
        f"{r['hooks_in_backward']}/{args.steps} steps"
    )


if __name__ == "__main__":
    main()
