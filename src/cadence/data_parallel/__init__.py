"""Data parallelism with caller-controlled gradient finalization."""

from cadence.data_parallel import comm_hooks
from cadence.data_parallel._embedding_exchange import EmbeddingExchange
from cadence.data_parallel._errors import DataParallelError, NothingToReduceError
from cadence.data_parallel._reducer import WindowState
from cadence.data_parallel._wrapper import DataParallel

__all__ = [
    "DataParallel",
    "DataParallelError",
    "EmbeddingExchange",
    "NothingToReduceError",
    "WindowState",
    "comm_hooks",
]
