"""cadence.pickling: a hardened by-value pickler for functions, closures and wrappers.

A drop-in for cloudpickle's API (``dumps``, ``dump``, ``loads``, ``load``, ``Pickler``,
the by-value registry, ``DEFAULT_PROTOCOL``) with: identity-based by-reference
decisions, shared closure cells, every function slot carried, unpicklable optional slots
pruned with a warning, errors that name the path to the offending object, deterministic
bytes, zero-copy out-of-band buffers under protocol 5, a signed, versioned envelope
(``dumps_signed`` / ``loads_signed``) and an allowlist loader (``loads_restricted``).

Which load is safe for what:

* ``loads`` / ``load`` (the standard ``pickle.loads``): trusted payloads only. A payload
  that holds a function by value runs its code; a malicious one runs anything.
* ``loads_signed``: payloads from producers that hold your key. It proves who made the
  payload and for which interpreter, before a byte is unpickled; it does not sandbox.
* ``loads_restricted``: unsigned payloads from a peer you do not fully trust. Only the
  globals an `Allowlist` names are resolved, dotted names only through classes, and the
  payload may change only the objects it created, so no code is built or called beyond
  the allowed globals. It does not bound memory or time (docs/pickling.md).

Nothing here needs torch; it only handles tensors when the caller has imported torch.
See docs/pickling.md.
"""

from cadence.pickling._errors import (
    EnvelopeError,
    ForbiddenGlobalError,
    IncompatiblePayloadError,
    MalformedPayloadError,
    PrunedSlotWarning,
    RecursionDepthError,
    SignatureError,
    UnpicklableError,
    UnsafeAllowlistError,
)
from cadence.pickling._lookup import (
    list_registry_pickle_by_value,
    register_pickle_by_value,
    unregister_pickle_by_value,
)
from cadence.pickling._pickler import DEFAULT_PROTOCOL, Pickler, dump, dumps, load, loads
from cadence.pickling._restricted import (
    Allowlist,
    RestrictedUnpickler,
    load_restricted,
    loads_restricted,
)
from cadence.pickling._signed import dumps_signed, loads_signed

# cloudpickle's older name for its Pickler, so code written against it keeps working.
CloudPickler = Pickler

__all__ = [
    "DEFAULT_PROTOCOL",
    "Allowlist",
    "CloudPickler",
    "EnvelopeError",
    "ForbiddenGlobalError",
    "IncompatiblePayloadError",
    "MalformedPayloadError",
    "Pickler",
    "PrunedSlotWarning",
    "RecursionDepthError",
    "RestrictedUnpickler",
    "SignatureError",
    "UnpicklableError",
    "UnsafeAllowlistError",
    "dump",
    "dumps",
    "dumps_signed",
    "list_registry_pickle_by_value",
    "load",
    "load_restricted",
    "loads",
    "loads_restricted",
    "loads_signed",
    "register_pickle_by_value",
    "unregister_pickle_by_value",
]
