"""Write the frozen payloads that later versions of cadence must still load.

Run ``python tests/pickling/old_pickles/generate.py`` only when adding a new set (for a
new interpreter version); never to refresh an existing set, which would defeat its
purpose. The objects are built from ``SOURCE`` in a namespace named ``__main__``, with
a fixed file name, so everything travels by value and no local path is embedded.
test_old_pickles.py holds the expected behaviour of each object (``CHECKS``).
"""

from __future__ import annotations

import collections
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2])]

from cadence import pickling  # noqa: E402

SIGNING_KEY = b"cadence-old-pickles-test-key-v1"

SOURCE = textwrap.dedent(
    '''
    import abc, collections, dataclasses, enum, functools, types, typing

    def make_counter(start, *, step=1):
        """A counter closure."""
        count = start

        def inc(by: int = 0) -> int:
            nonlocal count
            count += step + by
            return count

        def get():
            return count

        return inc, get

    def make_fact():
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)
        return fact

    SCALE = 3

    def scaled(fn):
        @functools.wraps(fn)
        def wrapper(x):
            return fn(x) * SCALE
        return wrapper

    def base(x):
        """Base docstring."""
        return x + 1

    class Point:
        __slots__ = ("x", "y")
        origin_name = "origin"

        def __init__(self, x, y):
            self.x, self.y = x, y

        @property
        def norm1(self):
            return abs(self.x) + abs(self.y)

        @classmethod
        def origin(cls):
            return cls(0, 0)

        @staticmethod
        def add(a, b):
            return a + b

    class Color(enum.Enum):
        RED = 1
        GREEN = 2

        def shout(self):
            return self.name.upper()

    @dataclasses.dataclass(repr=False)  # repr=True adds a stdlib closure (and its path)
    class Config:
        lr: float
        tags: list = dataclasses.field(default_factory=list)
        steps: typing.ClassVar[int] = 10

        def scaled(self, k):
            return self.lr * k

    class Shape(abc.ABC):
        @abc.abstractmethod
        def area(self): ...

    class Square(Shape):
        def area(self):
            return 4

    Shape.register(tuple)

    T = typing.TypeVar("T", bound=int)
    P = typing.ParamSpec("P")
    UserId = typing.NewType("UserId", int)

    class Box(typing.Generic[T]):
        def __init__(self, item: T):
            self.item = item

    dyn = types.ModuleType("frozen_dynamic_module")
    exec("OFFSET = 10\\ndef shift(x):\\n    return x + OFFSET\\n", dyn.__dict__)
    '''
)


def objects() -> dict[str, object]:
    ns: dict[str, object] = {"__name__": "__main__"}
    # dont_inherit: this file's own `from __future__ import annotations` must not apply.
    exec(compile(SOURCE, "<cadence old pickles>", "exec", dont_inherit=True), ns)
    return {
        "counter": ns["make_counter"](10, step=2),
        "recursive": ns["make_fact"](),
        "wrapper": ns["scaled"](ns["base"]),
        "class_instance": (ns["Point"], ns["Point"](3, -4)),
        "enum": (ns["Color"], ns["Color"].GREEN),
        "dataclass": ns["Config"](0.5, ["a"]),
        "abc": (ns["Shape"], ns["Square"]()),
        "typing": (ns["T"], ns["P"], ns["UserId"], ns["Box"], ns["Box"][int]),
        "module": ns["dyn"],
        # A tuple, not a dict: sets are written sorted at the top level and inside
        # tuples, but in hash order inside a dict (see "Limits" in docs/pickling.md).
        "data": (
            {"a": 1, "b": 2}.keys(),
            collections.OrderedDict(x=1).items(),
            memoryview(bytearray(range(12))).cast("i", (3,)),
            {"b", "a"},
            frozenset({3, 1}),
        ),
    }


def main() -> None:
    impl = f"{sys.implementation.name}_{sys.version_info[0]}{sys.version_info[1]}"
    out = HERE / impl
    out.mkdir(exist_ok=True)
    for name, obj in objects().items():
        for protocol in (4, 5):
            (out / f"{name}.p{protocol}.pkl").write_bytes(pickling.dumps(obj, protocol=protocol))
    (out / "signed.pkl").write_bytes(pickling.dumps_signed(objects()["recursive"], SIGNING_KEY))
    print(f"wrote {len(list(out.glob('*.pkl')))} payloads to {out}")


if __name__ == "__main__":
    main()
