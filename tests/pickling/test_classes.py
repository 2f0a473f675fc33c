"""Classes by value (B21): class bodies, enums, dataclasses, ABCs, type hints, generics,
and the typing objects tracked like classes (TypeVar, ParamSpec, TypeVarTuple, NewType).

``rt_rebuilt`` loads with an empty class tracker, as a fresh process would, so the
class really is rebuilt; ``rt`` loads in this process, where the tracker maps a class
back onto the live one (cloudpickle's provenance tracking).
"""

import abc
import collections
import copyreg
import dataclasses
import enum
import functools
import pickle
import typing

import pytest

from cadence import pickling
from tests.pickling._harness import fresh_tracker, rt, rt_rebuilt
from tests.pickling.fixtures import fx_typing

# No torch here: run once, not on every torch lane (see tests/conftest.py).
pytestmark = pytest.mark.torch_free


# Class bodies ------------------------------------------------------------------------------
def test_local_class_with_super_docstring_and_nested_references(protocol):
    LOCAL_CONSTANT = 42

    def some_function(x, y):
        sum(range(10))  # builtins must work in the rebuilt function
        return (x + y) / LOCAL_CONSTANT

    hidden_constant = lambda: LOCAL_CONSTANT  # noqa: E731

    class Base:
        def method(self):
            return 1

    class SomeClass(Base):
        """Overly complicated class with nested references to symbols"""

        def __init__(self, value):
            self.value = value

        def method(self):
            return super().method() + 1

        def one(self):
            return LOCAL_CONSTANT / hidden_constant()

        def some_method(self, x):
            return self.one() + some_function(x, 1) + self.value

    clone, inst, bound = rt_rebuilt((SomeClass, SomeClass(5), SomeClass(5).some_method), protocol)
    assert clone is not SomeClass and clone.__doc__ == SomeClass.__doc__
    assert clone(1).one() == 1 and clone(5).some_method(41) == 7 and clone(0).method() == 2
    assert type(inst) is clone and inst.some_method(41) == 7 and bound(41) == 7


def test_cycle_in_class_dict(protocol):
    class C:
        def it_works(self):
            return "woohoo!"

    C.C_again = C
    C.instance_of_C = C()
    clone = rt_rebuilt(C, protocol)
    assert clone().it_works() == "woohoo!"
    assert clone.C_again is clone and type(clone.instance_of_C) is clone


def test_slots_as_str_or_list_and_a_dict_subclass(protocol):
    for slots in (["registered_attribute"], "registered_attribute"):

        class ClassWithSlots:
            __slots__ = slots

            def __init__(self):
                self.registered_attribute = 42

        class SubclassWithSlots(ClassWithSlots):
            def __init__(self):
                self.unregistered_attribute = 1

        obj, sub = rt_rebuilt((ClassWithSlots(), SubclassWithSlots()), protocol)
        assert type(obj).__slots__ == slots and obj.registered_attribute == 42
        with pytest.raises(AttributeError):
            obj.non_registered_attribute = 1
        assert sub.unregistered_attribute == 1


def test_properties_read_only_and_read_write(protocol):
    class MyObject:
        _read_only_value = 1
        _read_write_value = 1

        @property
        def read_only_value(self):
            "A read-only attribute"
            return self._read_only_value

        @property
        def read_write_value(self):
            return self._read_write_value

        @read_write_value.setter
        def read_write_value(self, value):
            self._read_write_value = value

    obj = MyObject()
    obj.read_write_value = 2
    clone = rt_rebuilt(obj, protocol)
    assert (clone.read_only_value, clone.read_write_value) == (1, 2)
    with pytest.raises(AttributeError):
        clone.read_only_value = 2
    clone.read_write_value = 3
    assert clone.read_write_value == 3
    assert type(clone).read_only_value.__doc__ == "A read-only attribute"


def test_cached_property_in_a_local_class(protocol):
    class Lazy:
        calls = 0

        @functools.cached_property
        def value(self):
            """Computed once."""
            type(self).calls += 1
            return 7

    clone = rt_rebuilt(Lazy, protocol)
    obj = clone()
    assert (obj.value, obj.value, clone.calls) == (7, 7, 1)
    assert clone.__dict__["value"].__doc__ == "Computed once."


def test_class_annotations_self_reference_and_other_local_types(protocol):
    class Other:
        pass

    class Node:
        def link(self, other: "Node") -> Other:
            return Other()

        def same(self, x: Other) -> "Node":
            return self

    Node.__annotations__ = {"next": Node, "payload": Other, "n": int}
    clone = rt_rebuilt(Node, protocol)
    other = clone.__annotations__["payload"]
    assert clone.__annotations__["next"] is clone and clone.__annotations__["n"] is int
    assert other.__name__ == "Other" and other is not Other
    assert clone.same.__annotations__["x"] is other
    assert isinstance(clone().link(clone()), other)


def _all_types_to_test():
    T = typing.TypeVar("T")

    class C(typing.Generic[T]):
        pass

    return [
        C, C[int], T, typing.Any, typing.Optional, typing.Generic, typing.Union,
        typing.Optional[int], typing.Generic[T], typing.Callable[[int], typing.Any],  # noqa: UP045
        typing.Callable[..., typing.Any], typing.Callable[[], typing.Any],
        typing.Tuple[int, ...], typing.Tuple[int, C[int]], typing.List[int],  # noqa: UP006
        typing.Dict[int, str], typing.ClassVar, typing.ClassVar[C[int]],  # noqa: UP006
        typing.NoReturn, list[C[int]], int | C[int],
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_all_types_to_test())))
def test_local_class_with_type_hints(protocol, index):
    type_ = _all_types_to_test()[index]

    class MyClass:
        def method(self, arg: type_) -> type_:
            return arg

    MyClass.__annotations__ = {"attribute": type_}
    obj, sent_type = rt_rebuilt((MyClass(), type_), protocol)
    assert type(obj).__annotations__["attribute"] == sent_type
    assert obj.method.__annotations__ == {"arg": sent_type, "return": sent_type}


# Enums, dataclasses, named tuples --------------------------------------------------------------
def test_local_enums_members_identity_and_provenance(protocol):
    class StringEnum(str, enum.Enum):
        """Enum when all members are also (and must be) strings"""

    class Color(StringEnum):
        RED = "1"
        GREEN = "2"

        def is_green(self):
            return self is Color.GREEN

    green1, green2, cloned = rt_rebuilt([Color.GREEN, Color.GREEN, Color], protocol)
    assert green1 is green2 is cloned.GREEN and green1 is not cloned.RED
    assert isinstance(green1, str) and green1.is_green() and cloned is not Color
    # In the dumping process the tracker maps the class back onto the original.
    assert rt([Color.GREEN, Color], protocol) == [Color.GREEN, Color]
    dynamic = enum.IntEnum("Color", {"RED": 1, "GREEN": 2, "BLUE": 3})
    g1, g2, cloned = rt_rebuilt([dynamic.GREEN, dynamic.GREEN, dynamic], protocol)
    assert g1 is g2 is cloned.GREEN and g1 == 2 and cloned.BLUE.value == 3


def test_dataclass_fields_sentinels_and_make_dataclass(protocol):
    @dataclasses.dataclass
    class Sample:
        x: int
        y: dataclasses.InitVar[int]
        z: typing.ClassVar[int] = 3
        tags: list = dataclasses.field(default_factory=list)

        def __post_init__(self, y):
            self.x += y

    clone = rt_rebuilt(Sample, protocol)
    kinds = {f.name: f._field_type for f in clone.__dataclass_fields__.values()}
    assert kinds == {"x": dataclasses._FIELD, "y": dataclasses._FIELD_INITVAR,
                     "z": dataclasses._FIELD_CLASSVAR, "tags": dataclasses._FIELD}  # fmt: skip
    assert [f.name for f in dataclasses.fields(clone)] == ["x", "tags"]
    assert clone(1, 2).x == 3 and clone(1, 0).tags == []
    made = dataclasses.make_dataclass("DataClass", [("x", int)])
    assert rt_rebuilt(made(x=42), protocol).x == 42


def test_named_tuples_local(protocol):
    MyTuple = collections.namedtuple("MyTuple", ["a", "b", "c"])

    class Typed(typing.NamedTuple):
        a: int
        b: int = 2

    t1, cls1, t2 = rt([MyTuple(1, 2, 3), MyTuple, Typed(1)], protocol)
    assert cls1 is MyTuple and t1 == MyTuple(1, 2, 3) and isinstance(t2, Typed)
    r1, rcls, r2 = rt_rebuilt([MyTuple(1, 2, 3), MyTuple, Typed(1)], protocol)
    assert type(r1) is rcls and r1.c == 3 and r2.b == 2 and r2._fields == ("a", "b")


# ABCs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["decorators", "deprecated"])
def test_local_abc_abstract_members_and_registry(protocol, style):
    if style == "decorators":

        class AbstractClass(abc.ABC):
            @abc.abstractmethod
            def some_method(self):
                """A method"""

            @classmethod
            @abc.abstractmethod
            def some_classmethod(cls):
                """A classmethod"""

            @staticmethod
            @abc.abstractmethod
            def some_staticmethod():
                """A staticmethod"""

            @property
            @abc.abstractmethod
            def some_property(self):
                """A property"""
    else:

        class AbstractClass(abc.ABC):  # type: ignore[no-redef]
            @abc.abstractmethod
            def some_method(self):
                """A method"""

            @abc.abstractclassmethod
            def some_classmethod(cls):
                """A classmethod"""

            @abc.abstractstaticmethod
            def some_staticmethod():
                """A staticmethod"""

            @abc.abstractproperty
            def some_property(self):
                """A property"""

    class ConcreteClass(AbstractClass):
        def some_method(self):
            return "it works!"

        @classmethod
        def some_classmethod(cls):
            return "it works!"

        @staticmethod
        def some_staticmethod():
            return "it works!"

        @property
        def some_property(self):
            return "it works!"

    AbstractClass.register(tuple)
    base, concrete, inst = rt_rebuilt((AbstractClass, ConcreteClass, ConcreteClass()), protocol)
    assert base is not AbstractClass and issubclass(tuple, base)
    assert issubclass(concrete, base) and type(inst) is concrete
    assert inst.some_method() == inst.some_classmethod() == "it works!"
    assert inst.some_staticmethod() == inst.some_property == "it works!"
    with pytest.raises(TypeError):
        base()

    class Incomplete(base):
        def some_method(self):
            return "lacks the others"

    with pytest.raises(TypeError):
        Incomplete()


class MyUnrelatedClass:
    pass


class MyRelatedClass:
    pass


def test_abc_caches_not_pickled_registry_kept(protocol):
    MyClass = abc.ABCMeta("MyClass", (), {})
    MyClass.register(MyRelatedClass)
    assert not issubclass(MyUnrelatedClass, MyClass) and issubclass(MyRelatedClass, MyClass)
    data = pickling.dumps(MyClass, protocol=protocol)
    assert b"MyUnrelatedClass" not in data and b"MyRelatedClass" in data
    with fresh_tracker():
        clone = pickle.loads(data)
    assert not issubclass(MyUnrelatedClass, clone) and issubclass(MyRelatedClass, clone)


# Generics and typing objects -----------------------------------------------------------------
def test_generic_classes_and_subclasses(protocol):
    T = typing.TypeVar("T")

    class Base(typing.Generic[T]):
        pass

    class DerivedAny(Base):
        pass

    class DerivedInt(Base[int]):
        pass

    class DerivedT(Base[T]):
        pass

    class LeafT(DerivedT[T]):
        pass

    klasses = [Base, DerivedAny, DerivedInt, DerivedT, LeafT]
    assert rt(klasses, protocol) == klasses
    assert rt(Base[int], protocol) == Base[int]
    clones = rt_rebuilt(klasses, protocol)
    for k, c in zip(klasses, clones):
        assert [m.__name__ for m in c.mro()] == [m.__name__ for m in k.mro()]
    cbase, _, cint, cderived, cleaf = clones
    assert cbase.__parameters__[0].__name__ == "T" and cint.__orig_bases__[0].__args__ == (int,)
    assert cleaf.__orig_bases__[0].__origin__ is cderived
    assert cleaf[int].__args__ == (int,)


def test_typevar_by_value_attributes_and_memoization(protocol):
    class Bound:
        pass

    T = typing.TypeVar("T", bound=Bound, covariant=True)
    S = typing.TypeVar("S", int, str)
    t2, s2, t3 = rt_rebuilt((T, S, T), protocol)
    assert t2 is t3 and t2 is not T
    assert (t2.__name__, t2.__bound__.__name__, t2.__covariant__) == ("T", "Bound", True)
    assert s2.__constraints__ == (int, str) and not s2.__contravariant__
    assert rt(T, protocol) is T  # tracked: comes back as the original here


def test_paramspec_typevartuple_and_newtype_by_value(protocol):
    P = typing.ParamSpec("P")
    Ts = typing.TypeVarTuple("Ts")
    UserId = typing.NewType("UserId", int)
    p2, ts2, u2 = rt_rebuilt((P, Ts, UserId), protocol)
    assert type(p2) is typing.ParamSpec and p2.__name__ == "P" and p2 is not P
    assert type(ts2) is typing.TypeVarTuple and ts2.__name__ == "Ts"
    assert u2(5) == 5 and u2.__supertype__ is int and u2.__name__ == "UserId"
    assert rt((P, Ts, UserId), protocol) == (P, Ts, UserId)


def test_importable_typing_objects_by_reference(protocol):
    objs = (fx_typing.T, fx_typing.P, fx_typing.UserId, typing.AnyStr, fx_typing.some_singleton)
    data = pickling.dumps(objs, protocol=protocol)
    assert b"_make_" not in data
    with fresh_tracker():
        assert all(a is b for a, b in zip(pickle.loads(data), objs))


# Other class-level behaviours ---------------------------------------------------------------
def test_class_identity_across_two_payloads_and_two_fresh_loads(protocol):
    class K:
        pass

    assert rt(K, protocol) is K and rt(K(), protocol).__class__ is K
    a, b = pickling.dumps(K, protocol=protocol), pickling.dumps(K(), protocol=protocol)
    with fresh_tracker():
        k1, k2 = pickle.loads(a), type(pickle.loads(b))
    assert k1 is k2 is not K


def test_copyreg_dispatch_table_is_read_at_dump_time(protocol):
    class MyClass:
        pass

    copyreg.dispatch_table[MyClass] = lambda x: (MyClass, (), {"custom_reduce": True})
    try:
        assert rt(MyClass(), protocol).custom_reduce is True
    finally:
        copyreg.dispatch_table.pop(MyClass)


def test_properties_named_like_typing_markers_are_not_misdetected(protocol):
    class MyClass:
        @property
        def __values__(self):
            return ()

        @property
        def __type__(self):
            return int

    assert type(rt_rebuilt(MyClass(), protocol)).__name__ == "MyClass"


def test_custom_metaclass(protocol):
    class Meta(type):
        def describe(cls):
            return f"{cls.__name__} via Meta"

    class WithMeta(metaclass=Meta):
        x = 1

    clone = rt_rebuilt(WithMeta, protocol)
    assert type(clone).__name__ == "Meta" and clone.describe() == "WithMeta via Meta"
