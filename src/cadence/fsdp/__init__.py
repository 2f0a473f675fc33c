"""cadence's fully sharded data parallelism: ``fully_shard`` (see docs/fsdp.md)."""

from cadence.fsdp._api import MixedPrecisionPolicy
from cadence.fsdp._errors import FullyShardError, FullyShardValueError
from cadence.fsdp._forward_methods import register_fsdp_forward_method
from cadence.fsdp._fully_shard import FullyShardedModule, UnshardHandle, fully_shard

__all__ = [
    "FullyShardError",
    "FullyShardValueError",
    "FullyShardedModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
