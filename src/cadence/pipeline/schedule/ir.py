"""The pipeline schedule IR: actions, per-rank action lists, placement, (de)serialisers.

[Note: the cadence schedule IR]
A `Schedule` is data: ``placement[stage] -> rank`` plus, per rank, the ordered list
of `Action`s that rank executes. A generator emits a *compute-only* schedule
(F/B/I/W, maybe FB_OVERLAP); the passes in ``passes.py`` lower it by adding
SEND/RECV (cross-rank), LOCAL (same-rank hand-off) and the data-parallel actions.
The lowered schedule is exactly what the runtime executes, action by action: there
is no second representation of a schedule anywhere in cadence, so what the
simulator proved is what runs.

Conventions of a transfer action (the runtime relies on them):
- ``SEND``: ``stage`` is the producing stage, ``peer_stage`` the consuming stage.
- ``RECV``: ``stage`` is the consuming stage, ``peer_stage`` the producing stage.
- ``LOCAL``: ``stage`` is the producing stage, ``peer_stage`` the consumer, on the
  same rank; no P2P.
- A transfer built without ``peer_stage`` gets torch's implied neighbour
  (activations go to s+1, gradients to s-1), so ``peer_stage`` is always set.
- ``payload`` says what flows: ``Payload.ACT`` (forward activations, stage s ->
  s+1) or ``Payload.GRAD`` (input gradients, stage s -> s-1).
- ``channel = (src_rank, dst_rank)`` and ``seq`` (0-based, per channel, counting
  both payloads in program order of the sender) are set by lowering; the i-th SEND
  on a channel meets the i-th RECV on it.

The text form is torch's (``2F0``, ``3SEND_F1``, ``1UNSHARD``, ``0REDUCE_GRAD``),
so compute-only CSV files round-trip with torch's ``_Action.from_str``. Fields torch
has no spelling for are appended: ``~peer`` (a non-adjacent peer), ``.slot`` and
``#seq``, e.g. ``0SEND_F3~2#1``.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from cadence.pipeline.schedule._errors import ScheduleValidationError

__all__ = [
    "COMPUTE_KINDS",
    "IR_VERSION",
    "Action",
    "ActionKind",
    "Payload",
    "Schedule",
    "ScheduleMeta",
    "ScheduleValidationError",
    "parse_action",
]

IR_VERSION = 1


class ActionKind(Enum):
    """What one action does. Compute kinds are F, B, I, W and FB_OVERLAP."""

    F = "F"  # forward of one microbatch through one stage
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  # backward for the input gradient only (zero-bubble split)
    W = "W"  # backward for the weight gradient only
    FB_OVERLAP = "OVERLAP_F_B"  # DualPipeV: sub-actions run in order (or fused)
    SEND = "SEND"
    RECV = "RECV"
    LOCAL = "LOCAL"  # hand-off between two stages on the same rank
    WAIT_SEND = "WAIT_SEND"  # block until a previously issued SEND completed
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"  # issue the stage's gradient reduction (async)
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"  # wait for it
    BARRIER = "BARRIER"

    # [Note: enum members hash by identity]
    # Enum's own __hash__ is a Python function (hash of the member name), and the
    # passes, the validator and the simulator look kinds and payloads up in sets
    # and dict keys several times per action: at 10^5 actions that was the largest
    # single cost of a proof. Members are singletons compared by identity, so the
    # identity hash agrees with their equality; it is no less stable than the name
    # hash, which Python salts per process.
    __hash__ = object.__hash__


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_TRANSFER = frozenset({ActionKind.SEND, ActionKind.RECV, ActionKind.LOCAL, ActionKind.WAIT_SEND})
_STAGE_ONLY = frozenset(
    {ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD, ActionKind.WAIT_REDUCE_GRAD}
)


class Payload(Enum):
    """What a transfer carries. The value is torch's suffix letter (SEND_F / SEND_B)."""

    ACT = "F"
    GRAD = "B"

    __hash__ = object.__hash__  # see [Note: enum members hash by identity]


@dataclass(frozen=True)
class Action:
    """One action of one rank. Frozen and hashable; ``str()`` is the torch-style form."""

    kind: ActionKind
    stage: int
    mb: int | None = None
    peer_stage: int | None = None
    payload: Payload | None = None
    slot: int = 0
    channel: tuple[int, int] | None = None
    seq: int | None = None
    sub: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise TypeError(f"Action.kind must be an ActionKind, got {self.kind!r}")
        err = ScheduleValidationError
        if self.stage < 0:
            raise err(f"Action.stage must be >= 0, got {self.stage}")
        if self.mb is not None and self.mb < 0:
            raise err(f"Action.mb must be >= 0, got {self.mb} ({self.kind.name})")
        needs_mb = self.kind in COMPUTE_KINDS or self.kind in _TRANSFER
        if needs_mb and self.mb is None:
            raise err(f"{self.kind.name} on stage {self.stage} needs a microbatch index")
        if self.kind in _STAGE_ONLY and self.mb is not None:
            raise err(f"{self.kind.name} is per stage and takes no microbatch")
        if self.kind in _TRANSFER and self.payload is None:
            raise err(f"{self.kind.name} needs a payload (Payload.ACT or Payload.GRAD)")
        if self.kind is ActionKind.FB_OVERLAP and not self.sub:
            raise err("FB_OVERLAP needs its sub-actions")
        if self.kind in _TRANSFER and self.peer_stage is None:
            object.__setattr__(self, "peer_stage", self.default_peer)  # frozen: set once here

    # -- derived --------------------------------------------------------------

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS or self.kind is ActionKind.FB_OVERLAP

    @property
    def default_peer(self) -> int | None:
        """The peer torch leaves implicit: activations go to s+1, gradients to s-1."""
        if self.kind not in _TRANSFER or self.payload is None:
            return None
        forward = self.payload is Payload.ACT
        if self.kind is ActionKind.RECV:
            return self.stage - 1 if forward else self.stage + 1
        return self.stage + 1 if forward else self.stage - 1

    def linked(self, channel: tuple[int, int] | None, seq: int | None) -> Action:
        """This action with ``channel`` and ``seq`` set: ``replace(a, channel=..., seq=...)``.

        Lowering renumbers every transfer of a schedule, and `dataclasses.replace`
        re-runs ``__init__`` and the checks of ``__post_init__`` for each one;
        neither field takes part in those checks, so the copy skips them.
        """
        if channel == self.channel and seq == self.seq:
            return self  # frozen: an equal copy would only cost memory
        new = object.__new__(Action)
        new.__dict__.update(self.__dict__, channel=channel, seq=seq)
        return new

    def compute_parts(self) -> tuple[Action, ...]:
        """The compute actions this one stands for (itself, or FB_OVERLAP's subs)."""
        if self.kind is ActionKind.FB_OVERLAP:
            return self.sub
        return (self,) if self.kind in COMPUTE_KINDS else ()

    def __str__(self) -> str:
        if self.kind is ActionKind.FB_OVERLAP:
            return "(" + ";".join(str(a) for a in self.sub) + ")OVERLAP_F_B"
        name = self.kind.value
        if self.kind in _TRANSFER:
            name = f"{name}_{self.payload.value}"  # type: ignore[union-attr]  # Action.__post_init__ sets a transfer's peer and payload; Optional on Action
        text = f"{self.stage}{name}{'' if self.mb is None else self.mb}"
        # LOCAL always names its consumer; SEND/RECV only when torch's implied
        # neighbour (s+1 / s-1) is not the peer (skip connections, V turn).
        implied = self.kind is not ActionKind.LOCAL and self.peer_stage == self.default_peer
        if self.peer_stage is not None and not implied:
            text += f"~{self.peer_stage}"
        if self.slot:
            text += f".{self.slot}"
        if self.seq is not None:
            text += f"#{self.seq}"
        return text

    def __repr__(self) -> str:
        ch = f" ch={self.channel[0]}->{self.channel[1]}" if self.channel else ""
        return f"Action({self}{ch})"

    # -- JSON -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.name, "stage": self.stage}
        if self.mb is not None:
            d["mb"] = self.mb
        if self.peer_stage is not None:
            d["peer_stage"] = self.peer_stage
        if self.payload is not None:
            d["payload"] = self.payload.name
        if self.slot:
            d["slot"] = self.slot
        if self.channel is not None:
            d["channel"] = list(self.channel)
        if self.seq is not None:
            d["seq"] = self.seq
        if self.sub:
            d["sub"] = [a.to_dict() for a in self.sub]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Action:
        return cls(
            kind=ActionKind[d["kind"]],
            stage=int(d["stage"]),
            mb=d.get("mb"),
            peer_stage=d.get("peer_stage"),
            payload=Payload[d["payload"]] if d.get("payload") else None,
            slot=int(d.get("slot", 0)),
            channel=tuple(d["channel"]) if d.get("channel") is not None else None,
            seq=d.get("seq"),
            sub=tuple(cls.from_dict(s) for s in d.get("sub", ())),
        )


# Longest names first, so that RECV_F does not match as R..., REDUCE_GRAD before RESHARD.
_NAMES = {
    "WAIT_REDUCE_GRAD": (ActionKind.WAIT_REDUCE_GRAD, None),
    "REDUCE_GRAD": (ActionKind.REDUCE_GRAD, None),
    "UNSHARD": (ActionKind.UNSHARD, None),
    "RESHARD": (ActionKind.RESHARD, None),
    "BARRIER": (ActionKind.BARRIER, None),
    "WAIT_SEND_F": (ActionKind.WAIT_SEND, Payload.ACT),
    "WAIT_SEND_B": (ActionKind.WAIT_SEND, Payload.GRAD),
    "SEND_F": (ActionKind.SEND, Payload.ACT),
    "SEND_B": (ActionKind.SEND, Payload.GRAD),
    "RECV_F": (ActionKind.RECV, Payload.ACT),
    "RECV_B": (ActionKind.RECV, Payload.GRAD),
    "LOCAL_F": (ActionKind.LOCAL, Payload.ACT),
    "LOCAL_B": (ActionKind.LOCAL, Payload.GRAD),
    "F": (ActionKind.F, None),
    "B": (ActionKind.B, None),
    "I": (ActionKind.I, None),
    "W": (ActionKind.W, None),
}
_ACTION_RE = re.compile(
    r"^(\d+)(" + "|".join(_NAMES) + r")(\d*)(?:~(\d+))?(?:\.(\d+))?(?:#(\d+))?$"
)


def parse_action(text: str) -> Action:
    """Parse the text form (torch's ``2F0``/``3SEND_F1``, plus cadence's suffixes)."""
    s = text.strip()
    if s.endswith(")OVERLAP_F_B") and s.startswith("("):
        subs = tuple(parse_action(p) for p in s[1 : -len(")OVERLAP_F_B")].split(";"))
        return Action(ActionKind.FB_OVERLAP, subs[0].stage, subs[0].mb, sub=subs)
    m = _ACTION_RE.match(s)
    if m is None:
        raise ScheduleValidationError(
            f"cannot parse action {text!r}: expected e.g. '2F0', '3SEND_F1', '1UNSHARD', "
            "'(0F3;1B1)OVERLAP_F_B', optionally with '~peer', '.slot', '#seq'"
        )
    stage, name, mb, peer, slot, seq = m.groups()
    kind, payload = _NAMES[name]
    return Action(
        kind,
        int(stage),
        int(mb) if mb else None,
        peer_stage=int(peer) if peer else None,
        payload=payload,
        slot=int(slot) if slot else 0,
        seq=int(seq) if seq else None,
    )


@dataclass(frozen=True)
class ScheduleMeta:
    """Where a schedule came from: generator name, ranks p, chunks v, microbatches m."""

    generator: str = "custom"
    p: int = 0
    v: int = 0
    m: int = 0
    version: int = IR_VERSION
    lowered: bool = False


@dataclass(frozen=True)
class Schedule:
    """Placement (``placement[stage] = rank``) plus the ordered actions of every rank.

    Build with `Schedule.from_lists` (accepts actions or their text, ``None`` = idle).
    ``ranks[r]`` is rank r's action tuple. Idle slots are not stored: the simulator
    and the runtime are event driven.
    """

    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    meta: ScheduleMeta = field(default_factory=ScheduleMeta)

    def __post_init__(self) -> None:
        if not self.placement:
            raise ScheduleValidationError("a schedule needs at least one stage in its placement")
        n = len(self.ranks)
        for s, r in enumerate(self.placement):
            if not 0 <= r < n:
                raise ScheduleValidationError(
                    f"stage {s} is placed on rank {r}, but the schedule has ranks 0..{n - 1}"
                )
        for r, acts in enumerate(self.ranks):
            for a in acts:
                for part in (a, *a.sub):
                    if part.stage >= len(self.placement):
                        raise ScheduleValidationError(
                            f"rank {r}: action {part} names stage {part.stage}, but the "
                            f"placement has stages 0..{len(self.placement) - 1}"
                        )

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_lists(
        cls,
        actions: Mapping[int, Iterable[Action | str | None]]
        | Sequence[Iterable[Action | str | None]],
        placement: Mapping[int, int] | Sequence[int] | None = None,
        *,
        generator: str = "custom",
        v: int | None = None,
        m: int | None = None,
        lowered: bool | None = None,
    ) -> Schedule:
        """Build from per-rank lists (Python or parsed CSV); infer placement if omitted.

        Placement inference takes each stage's rank from its compute actions and
        raises `ScheduleValidationError` if a stage computes on two ranks.
        """
        if isinstance(actions, Mapping):
            keys = sorted(actions)
            if keys != list(range(len(keys))):
                raise ScheduleValidationError(
                    f"ranks must be 0..{len(keys) - 1} without gaps, got {keys}"
                )
            rows = [actions[k] for k in keys]
        else:
            rows = list(actions)
        ranks = tuple(
            tuple(parse_action(a) if isinstance(a, str) else a for a in row if a not in (None, ""))
            for row in rows
        )
        if placement is None:
            place = _infer_placement(ranks)
        elif isinstance(placement, Mapping):
            if sorted(placement) != list(range(len(placement))):
                raise ScheduleValidationError(
                    f"placement stages must be 0..{len(placement) - 1}, got {sorted(placement)}"
                )
            place = tuple(int(placement[s]) for s in range(len(placement)))
        else:
            place = tuple(int(r) for r in placement)
        mbs = {p.mb for row in ranks for a in row for p in a.compute_parts() if p.mb is not None}
        is_lowered = any(a.kind in _TRANSFER for row in ranks for a in row)
        meta = ScheduleMeta(
            generator=generator,
            p=len(ranks),
            v=v if v is not None else max(1, len(place) // max(1, len(ranks))),
            m=m if m is not None else (max(mbs) + 1 if mbs else 0),
            lowered=is_lowered if lowered is None else lowered,
        )
        return cls(place, ranks, meta)

    # -- accessors ------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def as_dict(self) -> dict[int, list[Action]]:
        return {r: list(a) for r, a in enumerate(self.ranks)}

    def to_text(self) -> dict[int, list[str]]:
        return {r: [str(a) for a in acts] for r, acts in enumerate(self.ranks)}

    def with_ranks(
        self, ranks: Sequence[Sequence[Action]], *, lowered: bool | None = None
    ) -> Schedule:
        meta = self.meta if lowered is None else replace(self.meta, lowered=lowered)
        return Schedule(self.placement, tuple(tuple(r) for r in ranks), meta)

    # -- JSON -----------------------------------------------------------------

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text (written to ``path`` too if given); every field explicit."""
        doc = {
            "format": "cadence.pipeline.schedule",
            "version": self.meta.version,
            "meta": {
                "generator": self.meta.generator,
                "p": self.meta.p,
                "v": self.meta.v,
                "m": self.meta.m,
                "lowered": self.meta.lowered,
            },
            "placement": list(self.placement),
            "ranks": [[a.to_dict() for a in acts] for acts in self.ranks],
        }
        text = json.dumps(doc, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Schedule:
        """Load from JSON text or a path to a JSON file."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        doc = json.loads(text)
        if doc.get("format") != "cadence.pipeline.schedule":
            raise ScheduleValidationError(
                "not a cadence schedule JSON document (missing 'format' marker)"
            )
        if doc.get("version") != IR_VERSION:
            raise ScheduleValidationError(
                f"schedule JSON has IR version {doc.get('version')}, this cadence reads "
                f"version {IR_VERSION}; regenerate the file"
            )
        meta = ScheduleMeta(version=doc["version"], **doc["meta"])
        ranks = tuple(tuple(Action.from_dict(a) for a in acts) for acts in doc["ranks"])
        return cls(tuple(doc["placement"]), ranks, meta)

    # -- CSV (torch's _dump_csv format) ---------------------------------------

    def to_csv(self, path: str | Path | None = None) -> str:
        """One row per rank, one action string per cell (torch's ``_dump_csv``)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for acts in self.ranks:
            writer.writerow([str(a) for a in acts])
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_csv(
        cls,
        source: str | Path,
        placement: Mapping[int, int] | Sequence[int] | None = None,
        *,
        generator: str = "csv",
    ) -> Schedule:
        """Load torch's CSV (compute-only or with comms); empty cells are idle.

        ``source`` is a path, or CSV text if it contains a newline or a comma.
        """
        text = str(source)
        if "\n" not in text and "," not in text:
            text = Path(source).read_text()
        rows = [row for row in csv.reader(io.StringIO(text))]
        return cls.from_lists(rows, placement, generator=generator)


def _infer_placement(ranks: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    for r, acts in enumerate(ranks):
        for a in acts:
            for s in {a.stage, *(p.stage for p in a.sub)}:
                if s in seen and seen[s] != r:
                    raise ScheduleValidationError(
                        f"stage {s} appears on rank {seen[s]} and on rank {r} ({a}); a stage "
                        "must live on exactly one rank"
                    )
                seen[s] = r
    if not seen:
        raise ScheduleValidationError("cannot infer a placement from a schedule with no actions")
    n = max(seen) + 1
    missing = [s for s in range(n) if s not in seen]
    if missing:
        raise ScheduleValidationError(
            f"stages {missing} have no actions, so their rank is unknown; pass a placement"
        )
    return tuple(seen[s] for s in range(n))
