"""The child side of `cadence.launch`: ``python -m cadence._worker DIR RANK``."""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path


def _write(path: Path, data: bytes) -> None:
    # Write then rename, so the parent never reads a half-written file.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _whole_lines() -> None:
    """Make a rank's stdout and stderr write each line with one ``write(2)``.

    [Note: a rank's lines stay whole] Every rank shares the launcher's descriptors 1
    and 2. An unbuffered stream (``PYTHONUNBUFFERED``, or the fork server's streams a
    warm rank inherits) hands ``print``'s text and its newline to the kernel apart, so
    two ranks printing at once break each other's lines. A line-buffered stream over a
    buffer flushes at each newline: a line reaches the descriptor whole, as promptly.
    """
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        old.flush()
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            line_buffering=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def main(work: Path, rank: int) -> int:
    header = pickle.loads((work / "header.pkl").read_bytes())
    for entry in reversed(header["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    # SIGTERM from the supervisor should end the rank even inside a C++ collective wait.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    try:
        import torch

        if header["num_threads"] is not None:
            torch.set_num_threads(header["num_threads"])
        fn, args, kwargs = pickle.loads((work / "payload.pkl").read_bytes())
        if header["init"]:
            import cadence

            cadence.init(backend=header["backend"], timeout=header["timeout"])
        result = fn(*args, **kwargs)
        _write(work / f"result.{rank}", pickle.dumps(result))
    except BaseException as exc:
        info = {
            # CLOCK_MONOTONIC is machine-wide on Linux: the parent orders failures by it.
            "when": time.monotonic(),
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
        _write(work / f"error.{rank}", pickle.dumps(info))
        sys.stderr.flush()
        return 1
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    _whole_lines()
    code = main(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can make a normal exit hang.
    os._exit(code)
