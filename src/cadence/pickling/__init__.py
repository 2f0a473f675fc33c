"""cadence.pickling: a hardened by-value pickler for functions, closures and wrappers.

A drop-in for cloudpickle's API (``dumps``, ``dump``, ``loads``, ``load``, ``Pickler``,
the by-value registry, ``DEFAULT_PROTOCOL``) with: identity-based by-reference
decisions, shared closure cells, every function slot carried, unpicklable optional slots
pruned with a warning, errors that name the path to the offending object, deterministic
bytes, and a signed, versioned envelope (``dumps_signed`` / ``loads_signed``).

Like every pickler that ships code by value, loading runs code: load only payloads you
trust, or signed ones. See docs/pickling.md.
"""

from cadence.pickling._lookup import (
    list_registry_pickle_by_value,
    register_pickle_by_value,
    unregister_pickle_by_value,
)
from cadence.pickling._pickler import (
    DEFAULT_PROTOCOL,
    Pickler,
    PrunedSlotWarning,
    UnpicklableError,
    dump,
    dumps,
    load,
    loads,
)
from cadence.pickling._signed import (
    EnvelopeError,
    IncompatiblePayloadError,
    SignatureError,
    dumps_signed,
    loads_signed,
)

__all__ = [
    "DEFAULT_PROTOCOL",
    "EnvelopeError",
    "IncompatiblePayloadError",
    "Pickler",
    "PrunedSlotWarning",
    "SignatureError",
    "UnpicklableError",
    "dump",
    "dumps",
    "dumps_signed",
    "list_registry_pickle_by_value",
    "load",
    "loads",
    "loads_signed",
    "register_pickle_by_value",
    "unregister_pickle_by_value",
]
