"""The runtime's view of one lowered action, and adapters into it.

The executor (``runtime.py``) dispatches on `Op`, a flat record of exactly what a
handler needs: kind, stage, microbatch, the peer stage of a transfer, whether the
transfer carries activations or gradients, its channel and its per-channel
sequence number. Keeping this small record separate from the schedule IR means
the IR (``ir.py``, owned by the schedule layer) can grow fields without touching
the handlers, and a torch-lowered action list can be run too (interop).

The adapter reads the cadence IR by attribute name and is tolerant of the few
spellings the IR may use (``mb``/``microbatch``, ``peer_stage``/``peer``); a
missing field becomes ``None`` and the handler that needs it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COMPUTE", "Op", "from_action", "from_torch_actions"]

# Kinds the executor knows. FB_OVERLAP is executed as its sub-actions in order.
COMPUTE = frozenset({"F", "B", "I", "W"})
_KIND_ALIASES = {
    "FORWARD": "F",
    "FULL_BACKWARD": "B",
    "BACKWARD_INPUT": "I",
    "BACKWARD_WEIGHT": "W",
    "WAIT_REDUCE": "WAIT_REDUCE_GRAD",
    "OVERLAP_F_B": "FB_OVERLAP",
}


@dataclass(frozen=True)
class Op:
    """One executable action of one rank."""

    kind: str
    stage: int
    mb: int | None = None
    peer_stage: int | None = None
    grad: bool = False  # a transfer of gradients (backward direction) rather than activations
    channel: tuple[int, int] | None = None
    seq: int | None = None
    sub: tuple[Op, ...] = ()
    text: str = ""  # the original action's string form, for error reports

    def __str__(self) -> str:
        if self.text:
            return self.text
        mb = "" if self.mb is None else str(self.mb)
        return f"{self.stage}{self.kind}{mb}"


def _get(action: Any, *names: str) -> Any:
    for n in names:
        v = getattr(action, n, None)
        if v is not None:
            return v
    return None


def _kind_name(kind: Any) -> str:
    name = getattr(kind, "name", None) or str(kind)
    return _KIND_ALIASES.get(name, name)


def from_action(action: Any, stage_to_rank: Mapping[int, int] | Callable[[int], int]) -> Op:
    """A cadence IR action -> `Op` (see the module docstring for tolerated spellings)."""
    rank_of = stage_to_rank if callable(stage_to_rank) else stage_to_rank.__getitem__
    kind = _kind_name(_get(action, "kind"))
    stage = int(_get(action, "stage"))
    mb = _get(action, "mb", "microbatch")
    peer = _get(action, "peer_stage", "peer")
    sub = tuple(from_action(a, stage_to_rank) for a in (_get(action, "sub") or ()))
    grad = False
    direction = _get(action, "direction", "payload", "what")
    if kind.startswith(("SEND_", "RECV_")):
        kind, d = kind.split("_", 1)
        grad = d == "B"
    elif direction is not None:
        grad = str(getattr(direction, "name", direction)).upper() in ("B", "GRAD", "BACKWARD")
    elif peer is not None and kind in ("SEND", "RECV", "LOCAL"):
        # Without an explicit direction, the stage order tells it: activations flow
        # to later stages, gradients to earlier ones.
        grad = (int(peer) < stage) if kind in ("SEND", "LOCAL") else (int(peer) > stage)
    channel = _get(action, "channel")
    if channel is None and peer is not None and kind in ("SEND", "RECV"):
        src, dst = (stage, int(peer)) if kind == "SEND" else (int(peer), stage)
        channel = (rank_of(src), rank_of(dst))
    return Op(
        kind=kind,
        stage=stage,
        mb=None if mb is None else int(mb),
        peer_stage=None if peer is None else int(peer),
        grad=grad,
        channel=None if channel is None else (int(channel[0]), int(channel[1])),
        seq=_get(action, "seq"),
        sub=sub,
        text=str(action),
    )


def from_torch_actions(
    lowered: Mapping[int, Sequence[Any]], stage_to_rank: Mapping[int, int]
) -> dict[int, list[Op]]:
    """torch's ``pipeline_order_with_comms`` -> per-rank `Op` lists.

    torch leaves the peer implicit (F goes to s+1, B to s-1) and has no sequence
    numbers; they are assigned here per channel in program order, which is what a
    FIFO channel delivers. Same-rank neighbours have no comm action in torch's IR:
    the executor hands those over locally on its own (see runtime.py).
    """
    out: dict[int, list[Op]] = {}
    for rank, actions in lowered.items():
        seqs: dict[tuple[tuple[int, int], str], int] = {}
        ops = []
        for a in actions:
            if a is None:
                continue
            kind = _kind_name(a.computation_type)
            stage, mb = a.stage_index, a.microbatch_index
            if kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                base, d = kind.split("_")
                grad = d == "B"
                if base == "SEND":
                    peer = stage - 1 if grad else stage + 1
                    channel = (stage_to_rank[stage], stage_to_rank[peer])
                else:
                    peer = stage + 1 if grad else stage - 1
                    channel = (stage_to_rank[peer], stage_to_rank[stage])
                key = (channel, base)
                seq = seqs.get(key, 0)
                seqs[key] = seq + 1
                ops.append(Op(base, stage, mb, peer, grad, channel, seq, text=str(a)))
            elif kind == "FB_OVERLAP":
                subs = tuple(
                    Op(
                        _kind_name(s.computation_type),
                        s.stage_index,
                        s.microbatch_index,
                        text=str(s),
                    )
                    for s in a.sub_actions
                )
                ops.append(Op("FB_OVERLAP", stage, mb, sub=subs, text=str(a)))
            else:
                ops.append(Op(kind, stage, mb, text=str(a)))
        out[rank] = ops
    return out
