"""Communication hooks with torch DDP's signature: ``hook(state, bucket) -> Future | work``.

A hook receives the bucket's flat buffer **un-divided** (the DDP contract) and
is responsible for averaging. It returns either a ``torch.futures.Future`` whose
value is the reduced buffer (so torch's own DDP hooks work unchanged), or an
object with ``wait()`` / ``is_completed()`` after which the buffer holds the
result in place. The built-in hooks below go through `cadence.Comm`, so they are
counted in the wrapper's event log.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import torch
import torch.distributed as dist

from cadence.comm import Comm, CommWork
from cadence.data_parallel._buckets import Bucket
from cadence.errors import CadenceTypeError, CadenceValueError

__all__ = [
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "check_comm_hook",
    "fp16_compress_hook",
    "hook_result_error",
    "is_future",
]


class GradBucket:
    """The view of one bucket a hook gets (method names follow ``dist.GradBucket``)."""

    def __init__(self, bucket: Bucket, comm: Comm, *, is_last: bool) -> None:
        self._bucket = bucket
        self.comm = comm
        self._is_last = is_last

    def index(self) -> int:
        return int(self._bucket.index)

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        if self._bucket.sparse:  # the buffer is the sparse gradient itself: replaced
            self._bucket.buffer = tensor
            return
        self._bucket.buffer.copy_(tensor.reshape(-1))

    def gradients(self) -> list[torch.Tensor]:
        if self._bucket.sparse:
            return [self._bucket.buffer]
        return list(self._bucket.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last


class _CastBack:
    """Waits a compressed all-reduce, then writes it back into the full-precision buffer."""

    def __init__(self, work: CommWork, compressed: torch.Tensor, buffer: torch.Tensor) -> None:
        self._work = work
        self._compressed = compressed
        self._buffer = buffer
        self._done = False

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self) -> None:
        if self._done:
            return
        self._work.wait()
        self._buffer.copy_(self._compressed)
        self._done = True


def check_comm_hook(hook: object) -> None:
    """Refuse a hook at registration as torch DDP does, with its error types and words.

    Scripts and torch's own tests match these messages; cadence widens two of DDP's
    rules only as far as its own hooks need: the bucket may be annotated with this
    module's `GradBucket`, and the return with a work-like class (one with ``wait``).
    """
    if not callable(hook):
        raise CadenceTypeError("Communication hook must be callable.")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check, as nothing is declared
    try:  # string annotations (``from __future__ import annotations``) resolved
        hints = typing.get_type_hints(hook)
    except Exception:  # an unresolvable name: judge what is declared plainly
        hints = {}
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket") or (params[1] if len(params) > 1 else None)
    if bucket is not None:
        annotation = hints.get(bucket.name, bucket.annotation)
        if not isinstance(annotation, str) and annotation not in (
            inspect.Parameter.empty,
            dist.GradBucket,
            GradBucket,
            Any,
        ):
            raise CadenceValueError(
                "Communication hook: bucket annotation should be dist.GradBucket. "
                f"{_name(hook)} annotates it {annotation!r}."
            )
    returned = hints.get("return", sig.return_annotation)
    if isinstance(returned, str) or returned is inspect.Signature.empty:
        return
    if typing.get_origin(returned) is torch.futures.Future or returned is torch.futures.Future:
        return
    if isinstance(returned, type) and callable(getattr(returned, "wait", None)):
        return  # a work-like result (cadence's own hooks return one)
    raise CadenceValueError(
        "Communication hook: return annotation should be torch.futures.Future[torch.Tensor] "
        f"(or a work object with wait()); {_name(hook)} annotates {returned!r}."
    )


def hook_result_error(hook: object, result: object) -> str:
    """What a hook that returned neither a Future nor a work object is told at backward."""
    return (
        "Communication hook: callback must return a torch.futures.Future object, but got "
        f"{type(result).__name__} from {_name(hook)}. Fix: return the Future of the "
        "collective (e.g. dist.all_reduce(..., async_op=True).get_future()), or an object "
        "with wait() after which the bucket's buffer holds the result."
    )


def is_future(result: object) -> bool:
    """A torch future, whichever class made it.

    ``Future.then()`` and ``Work.get_future()`` return torch's C++ class, of which
    ``torch.futures.Future`` is only a Python subclass; checking the subclass missed
    them and treated their result as a work object, dropping a fresh tensor's value.
    """
    return isinstance(result, torch._C.Future)


def _name(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _comm(state: Any, bucket: GradBucket) -> Comm:
    return state if isinstance(state, Comm) else bucket.comm


def allreduce_hook(state: Any, bucket: GradBucket) -> CommWork:
    """Average the bucket with one all-reduce (what DataParallel does without a hook)."""
    comm = _comm(state, bucket)
    buf = bucket.buffer()
    buf.div_(comm.world_size)
    return comm.all_reduce(buf, async_op=True)


def _compress_hook(dtype: torch.dtype, state: Any, bucket: GradBucket) -> _CastBack:
    comm = _comm(state, bucket)
    buf = bucket.buffer()
    # Divide before the reduction, in full precision, so fp16 cannot overflow.
    compressed = buf.div(comm.world_size).to(dtype)
    return _CastBack(comm.all_reduce(compressed, async_op=True), compressed, buf)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> _CastBack:
    """All-reduce in fp16 (half the bytes on the wire), write back in the grad dtype."""
    return _compress_hook(torch.float16, state, bucket)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> _CastBack:
    """All-reduce in bf16, write back in the grad dtype."""
    return _compress_hook(torch.bfloat16, state, bucket)
