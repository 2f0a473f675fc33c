"""A driver script run as ``__main__`` (as a user's script or notebook runs), talking to
long-lived workers. One run per protocol; each section reports "ok" or its traceback,
and test_interactive.py turns each section into one test.

Usage: ``python _interactive_driver.py PROTOCOL``. Definitions live at module level
(inside ``with section(...)`` blocks, which open no scope), so they are ``__main__``
definitions, as interactively defined code is.
"""

import dataclasses
import difflib
import enum
import gc
import io
import pickle
import pickletools
import sys
import typing

from cadence import pickling
from tests.pickling._harness import ROOT, RemoteError, Sections, Worker

protocol = int(sys.argv[1])
section = Sections()
w = Worker(protocol)  # cannot import the tests package
w_repo = Worker(protocol, path=[str(ROOT)])  # can


def echo(*args):
    return args[0] if len(args) == 1 else args


def disassemble(data):
    out = io.StringIO()
    pickletools.dis(data, out)
    return out.getvalue().splitlines()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


with section("interactive_functions_and_classes"):
    CONSTANT = 42

    class Foo:
        def method(self, x):
            return x

    foo = Foo()

    def f0(x):
        return x**2

    def f1():
        return Foo

    def f2(x):
        return Foo().method(x)

    def f3():
        return Foo().method(CONSTANT)

    def f4(x):
        return foo.method(x)

    def f5(x):
        return f4(x) if x <= 0 else f5(x - 1) + 1

    assert w.run(echo, lambda x: x**2)(3) == 9
    assert w.run(echo, f0)(3) == 9
    assert w.run(echo, Foo)().method(2) == 2
    assert w.run(echo, Foo()).method(2) == 2
    assert w.run(echo, f1)()().method("a") == "a"
    assert w.run(echo, f2)(2) == 2 and w.run(echo, f3)() == 42
    assert w.run(echo, f4)(2) == 2 and w.run(echo, f5)(7) == 7
    assert w.run(f5, 7) == 7

with section("interactive_global_variable_isolation"):
    VARIABLE = "default_value"

    def g0():
        global VARIABLE
        VARIABLE = "changed_by_g0"

    def g1():
        return VARIABLE

    cloned_g0, cloned_g1 = w.run(echo, [g0, g1])
    assert cloned_g0.__globals__ is cloned_g1.__globals__ is not g0.__globals__
    pickled_g1 = pickling.dumps(g1, protocol=protocol)
    cloned_g0()
    assert VARIABLE == "default_value"
    assert cloned_g1() == "changed_by_g0"
    new_g1 = pickle.loads(pickled_g1)
    assert new_g1.__globals__ is not cloned_g1.__globals__ and new_g1() == "default_value"

with section("interactive_remote_function_calls"):

    def interactive_function(x):
        return x + 1

    assert w.run(interactive_function, 41) == 42

    def wrapper_func(x):
        return interactive_function(x)

    def interactive_function(x):
        return x - 1

    # The worker does not remember the previous definition.
    assert w.run(wrapper_func, 41) == 40

with section("interactive_remote_calls_no_side_effect"):
    GLOBAL_VARIABLE = 0

    class CustomClass:
        def mutate_globals(self):
            global GLOBAL_VARIABLE
            GLOBAL_VARIABLE += 1
            return GLOBAL_VARIABLE

    custom_object = CustomClass()
    assert w.run(custom_object.mutate_globals) == 1
    assert GLOBAL_VARIABLE == 0
    assert w.run(custom_object.mutate_globals) == 1  # the worker starts from zero again

    def is_in_main(name):
        return hasattr(sys.modules["__main__"], name)

    assert is_in_main("CustomClass") and not w.run(is_in_main, "CustomClass")
    assert is_in_main("GLOBAL_VARIABLE") and not w.run(is_in_main, "GLOBAL_VARIABLE")

with section("dynamic_class_and_remote_instances"):

    class CustomCounter:
        def __init__(self):
            self.count = 0

        def increment(self):
            self.count += 1
            return self

    counter = CustomCounter().increment()
    returned = w.run(counter.increment)
    assert returned.count == 2 and isinstance(returned, CustomCounter)
    C1, C2, c1, c2 = w.run(echo, CustomCounter, CustomCounter, CustomCounter(), returned)
    assert C1 is CustomCounter and C2 is CustomCounter
    assert isinstance(c1, CustomCounter) and isinstance(c2, CustomCounter)

with section("dynamic_class_and_stored_remote_instances"):

    class A:
        """Original class definition"""

    def store(x):
        import uuid

        storage = sys.__dict__.setdefault("_cadence_test_storage", {})
        obj_id = uuid.uuid4().hex
        storage[obj_id] = x
        return obj_id

    def lookup(obj_id):
        return sys._cadence_test_storage[obj_id]

    id1 = w.run(store, A())
    assert w.run(lambda obj_id: isinstance(lookup(obj_id), A), id1)
    assert isinstance(w.run(lookup, id1), A)

    class A:
        """Updated class definition"""

    assert not w.run(lambda obj_id: isinstance(lookup(obj_id), A), id1)
    retrieved1 = w.run(lookup, id1)
    assert not isinstance(retrieved1, A) and retrieved1.__class__ is not A
    assert retrieved1.__class__.__doc__ == "Original class definition"
    a = A()
    id2 = w.run(store, a)
    assert w.run(lambda obj_id: isinstance(lookup(obj_id), A), id2)
    assert isinstance(w.run(lookup, id2), A)
    # A method added to the live class is not sent with later calls: the worker keeps
    # the class it has (as in cloudpickle).
    A.echo = lambda cls, x: x
    assert w.run(a.echo, 42) == 42

with section("interactive_enum"):

    class Color(enum.Enum):
        RED = 1
        GREEN = 2

    def check_positive(x):
        return Color.GREEN if x >= 0 else Color.RED

    assert w.run(check_positive, 1) is Color.GREEN

    class Color(enum.Enum):  # type: ignore[no-redef]
        RED = 1
        BLUE = 2

    def check_positive(x):
        return Color.BLUE if x >= 0 else Color.RED

    assert w.run(check_positive, 1) is Color.BLUE

with section("interactive_abc"):
    import abc

    class Shape(abc.ABC):
        @abc.abstractmethod
        def area(self): ...

        @classmethod
        @abc.abstractmethod
        def unit(cls): ...

    class Square(Shape):
        def area(self):
            return 4

        @classmethod
        def unit(cls):
            return cls()

    class Virtual:
        pass

    Shape.register(Virtual)

    def check_abc(shape, square, virtual):
        try:
            shape()
        except TypeError:
            pass
        else:
            raise AssertionError("the loaded ABC is instantiable")
        assert isinstance(square, shape) and isinstance(virtual, shape)
        return square.unit().area()

    assert w.run(check_abc, Shape, Square(), Virtual()) == 4
    back_shape, back_square = w.run(echo, Shape, Square())
    assert back_shape is Shape and isinstance(back_square, Shape)

with section("interactive_dataclass"):

    @dataclasses.dataclass
    class SampleDataclass:
        x: int
        y: dataclasses.InitVar[int] = None
        z: typing.ClassVar[int] = 42

        def __post_init__(self, y=0):  # noqa: RUF033  (the shape cloudpickle's users write)
            self.x += y

        def large_enough(self):
            return self.x > self.z

    value = SampleDataclass(2, y=2)

    def check_dataclass_instance(value):
        assert isinstance(value, SampleDataclass) and value.x == 4 and value.z == 42
        assert dataclasses.asdict(value) == {"x": 4} and not value.large_enough()
        return "ok"

    assert w.run(check_dataclass_instance, value) == "ok"
    cloned_value, cloned_type = w.run(echo, value, SampleDataclass)
    assert cloned_type is SampleDataclass and isinstance(cloned_value, SampleDataclass)

with section("typing_objects_tracked_across_processes"):
    T = typing.TypeVar("T")
    P = typing.ParamSpec("P")
    UserId = typing.NewType("UserId", int)
    assert w.run(echo, T) is T and w.run(echo, P) is P and w.run(echo, UserId) is UserId

    class Gen(typing.Generic[T]):
        pass

    def check_generic(generic, origin, type_value):
        assert generic.__origin__ is origin
        assert origin.__orig_bases__[0].__origin__ is typing.Generic
        assert generic.__args__[0] is type_value and len(origin.__parameters__) == 1
        return "ok"

    assert w.run(check_generic, Gen[int], Gen, int) == "ok"
    assert w.run(echo, Gen[int]) == Gen[int]

with section("class_with_type_hints_in_worker"):
    hints = (
        Gen,
        Gen[int],
        T,
        typing.Optional[int],  # noqa: UP045  (the typing forms users still write)
        typing.Callable[[int], typing.Any],
        typing.Tuple[int, Gen[int]],  # noqa: UP006
        typing.ClassVar[Gen[int]],
    )
    for type_ in hints:

        class MyClass:
            def method(self, arg: type_) -> type_:
                return arg

        MyClass.__annotations__ = {"attribute": type_}

        def check_annotations(obj, expected_type):
            assert type(obj).__annotations__["attribute"] == expected_type
            assert obj.method.__annotations__ == {"arg": expected_type, "return": expected_type}
            return "ok"

        assert w.run(check_annotations, MyClass(), type_) == "ok"

with section("registered_module_constructs_in_a_worker_that_cannot_import_it"):
    from tests.pickling.fixtures import fx_local_only as mod

    def fails_remotely(fn):
        try:
            w.run(fn)
        except RemoteError as e:
            return "ModuleNotFoundError" in str(e)
        return False

    assert fails_remotely(lambda: mod.helper)
    pickling.register_pickle_by_value(mod)
    try:
        assert w.run(lambda: mod.helper(1)) == 11  # the module itself, by value
        assert w.run(lambda: mod.Point(2).shifted()) == 12
        assert w.run(lambda: mod.uses_helper(1)) == 22
    finally:
        pickling.unregister_pickle_by_value(mod)
    assert fails_remotely(lambda: mod.helper)

with section("registered_module_globals_follow_the_driver"):
    from tests.pickling.fixtures import fx_shared

    before = fx_shared.COUNTER[0]
    pickling.register_pickle_by_value(fx_shared)
    try:
        fx_shared.COUNTER[0] = before + 100
        assert w_repo.run(fx_shared.read) == before + 100  # by value: the driver's global
    finally:
        pickling.unregister_pickle_by_value(fx_shared)
        fx_shared.COUNTER[0] = before
    assert w_repo.run(fx_shared.read) == 0  # by reference: the worker's own module

with section("dynamic_module_forwarded_by_a_worker"):
    import types

    dyn = types.ModuleType("dyn")
    exec("x = 1\ndef f():\n    return x\n", dyn.__dict__)
    forwarded = w.run(lambda m, p: pickling.dumps(m, protocol=p), dyn, protocol)
    assert w_repo.run(lambda data: pickle.loads(data).f(), forwarded) == 1

with section("no_memory_leak_across_calls"):

    def make_big_closure(i):
        data = bytes([i % 256]) * 1_000_000

        def process_data():
            return len(data)

        return process_data

    w.run(make_big_closure(0))
    reference = w.run(rss_bytes)
    for i in range(40):
        assert w.run(make_big_closure(i)) == 1_000_000
    w.run(gc.collect)
    growth = w.run(rss_bytes) - reference
    assert growth < 20_000_000, growth  # 40 MB went through; little may stay

with section("deterministic_chained_class_pickling"):

    def same_bytes(obj):
        """The worker re-pickles what it loaded: the bytes must be the driver's own."""
        there = w.run(lambda o, p: pickling.dumps(o, protocol=p), obj, protocol)
        here = pickling.dumps(obj, protocol=protocol)
        assert there == here, "\n".join(
            difflib.unified_diff(disassemble(here), disassemble(there), lineterm="")
        )

    class B:
        """Simple class definition"""

    same_bytes(B)

    class B:  # type: ignore[no-redef]
        name = "B"
        __doc__ = "Updated class definition"

    same_bytes(B)

    class B:  # type: ignore[no-redef]
        def __init__(self):
            """Class definition with explicit __init__"""

    same_bytes(B)

with section("deterministic_str_interning_for_chained_dynamic_classes"):

    class I1:
        """Class with potential string interning issues."""

        arg_1 = "class_value"

        def join(self):
            pass

        def test_method(self, arg_1, join):
            pass

    same_bytes(I1)

    class I2:
        """Class with potential string interning issues."""

        arg_1 = "join"

        def join(self, arg_1):
            pass

    I2.join.arg_1 = "join"
    same_bytes(I2)

with section("deterministic_tuple_memoization_in_a_sub_worker"):

    class M:
        """Class with potential tuple memoization issues."""

        def func1(self):
            pass

        def func2(self):
            pass

    same_bytes(M)

with section("dynamic_function_and_class_bytes_same_in_two_processes"):

    def get_dynamic_func_pickle():
        def test_method(arg_1, arg_2):
            pass

        return pickling.dumps(test_method, protocol=protocol)

    def get_dynamic_class_pickle():
        class Dyn:
            """Class with potential string interning issues."""

            arg_1 = "class_value"

            def join(self):
                pass

        return pickling.dumps(Dyn, protocol=protocol)

    # cloudpickle gives a class a random uuid4 tracker id, so its own test of the
    # second case is an expected failure; cadence derives the id (see _tracker).
    assert w.run(get_dynamic_func_pickle) == get_dynamic_func_pickle()
    assert w.run(get_dynamic_class_pickle) == get_dynamic_class_pickle()

w.close()
w_repo.close()
section.report()
