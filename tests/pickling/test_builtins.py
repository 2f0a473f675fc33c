"""Built-in objects: dict views, memoryviews and zero-copy buffers, descriptors, WeakSet,
files, loggers and the rest of what cloudpickle handles beyond the standard pickler."""

import collections
import gc
import io
import itertools
import logging
import multiprocessing
import os
import pickle
import sys
import types
import weakref

import pytest

from cadence import pickling
from tests.pickling._harness import rt, rt_rebuilt


# dict views --------------------------------------------------------------------------------
@pytest.mark.parametrize("mapping", [dict, collections.OrderedDict])
def test_dict_views_keep_type_and_contents(protocol, mapping):
    d = mapping([("a", 1), ("b", 2)])
    keys, values, items = rt((d.keys(), d.values(), d.items()), protocol)
    assert type(keys) is type(d.keys()) and list(keys) == ["a", "b"] and keys == d.keys()
    assert type(values) is type(d.values()) and list(values) == [1, 2]
    assert type(items) is type(d.items()) and items == d.items()


def test_keys_view_does_not_ship_the_values(protocol):
    secrets = {"user": "a-secret-value"}
    assert b"a-secret-value" not in pickling.dumps(secrets.keys(), protocol=protocol)


# memoryviews -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: memoryview(b"Hello"),
        lambda: memoryview(bytearray(b"Hello!" * 3))[2:15:2],  # non-contiguous
        lambda: memoryview(bytearray(range(24))).cast("i", (2, 3)),  # 2-d, int items
        lambda: memoryview(bytes(8)).cast("d", ()),  # 0-d
        lambda: memoryview(b""),
    ],
    ids=["bytes", "strided", "2d-int", "0d-double", "empty"],
)
def test_memoryview_round_trip_keeps_format_shape_and_writability(protocol, make):
    view = make()
    loaded = rt(view, protocol)
    assert type(loaded) is memoryview
    assert (loaded.format, loaded.shape, loaded.readonly) == (view.format, view.shape,
                                                              view.readonly)  # fmt: skip
    assert loaded.tobytes() == view.tobytes() and loaded == view


def test_large_memoryview(protocol):
    view = memoryview(b"Hello!" * 2_000_000)  # 12 MB
    assert rt(view, protocol) == view


def test_memoryview_of_struct_format_comes_back_as_bytes_view(protocol):
    np = pytest.importorskip("numpy")
    records = np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])
    loaded = rt(memoryview(records), protocol)
    assert loaded.format == "B" and loaded.tobytes() == records.tobytes()


def test_memoryview_out_of_band_is_zero_copy():
    backing = bytearray(b"x" * 4096)
    view = memoryview(backing).cast("i", (32, 32))
    buffers: list = []
    data = pickling.dumps(view, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 200  # no byte of the buffer in the payload
    loaded = pickle.loads(data, buffers=buffers)
    assert (loaded.format, loaded.shape) == ("i", (32, 32))
    backing[0:4] = (7).to_bytes(4, sys.byteorder)  # the loaded view sees the original memory
    assert loaded[0, 0] == 7


def test_numpy_arrays_out_of_band_zero_copy():
    np = pytest.importorskip("numpy")

    class LocallyDefinedClass:
        data = np.arange(1000.0)

    buffers: list = []
    arr = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    data = pickling.dumps((arr, LocallyDefinedClass()), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and len(data) < 2000
    loaded, inst = pickle.loads(data, buffers=buffers)
    assert np.shares_memory(loaded, arr) and (loaded == arr).all()
    np.testing.assert_array_equal(type(inst).data, LocallyDefinedClass.data)


def test_torch_tensors_out_of_band_zero_copy_and_views_share_storage():
    torch = pytest.importorskip("torch")
    base = torch.arange(12, dtype=torch.float32)
    view = base.view(3, 4)[:, 1:3]  # non-contiguous view of the same storage
    leaf = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    buffers: list = []
    data = pickling.dumps((base, view, leaf), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and len(data) < 2000  # one buffer per storage
    b2, v2, l2 = pickle.loads(data, buffers=buffers)
    assert b2.data_ptr() == base.data_ptr()  # the very memory, not a copy
    assert v2.untyped_storage().data_ptr() == b2.untyped_storage().data_ptr()
    assert torch.equal(v2, view) and v2.stride() == view.stride()
    assert l2.requires_grad and l2.dtype == torch.bfloat16 and torch.equal(l2, leaf)
    # In band (no callback) the bytes are in the payload; the loaded tensor is its own.
    b3, v3, _ = pickle.loads(pickling.dumps((base, view, leaf), protocol=5))
    assert torch.equal(v3, view) and b3.data_ptr() != base.data_ptr()
    b3[5] = -1
    assert v3[1, 0] == -1  # views of one storage still share it


def test_torch_tensors_that_keep_torchs_own_reduce(protocol):
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.ones(2, 2))
    nonleaf = torch.ones(2, requires_grad=True) * 2
    tagged = torch.zeros(2)
    tagged.note = "kept"
    p2, t2, n2 = rt((param, tagged, nonleaf), protocol)
    assert isinstance(p2, torch.nn.Parameter) and p2.requires_grad and t2.note == "kept"
    assert n2.requires_grad and n2.grad_fn is None  # torch's rule: a leaf comes back


# Descriptors ------------------------------------------------------------------------------
def test_builtin_descriptors_by_reference(protocol):
    descriptors = [
        float.real,  # getset_descriptor
        float.__dict__["fromhex"],  # classmethod_descriptor
        type.__dict__["__basicsize__"],  # member_descriptor
        float.__dict__["__repr__"],  # wrapper_descriptor
        str.__dict__["upper"],  # method_descriptor
        types.FunctionType.__dict__["__globals__"],  # member_descriptor
        types.FunctionType.__dict__["__code__"],  # getset_descriptor
    ]
    assert all(a is b for a, b in zip(rt(descriptors, protocol), descriptors))
    assert rt(float.__dict__["fromhex"], protocol).__get__(None, float)("0x1") == 1.0


def test_slot_member_descriptor_of_a_local_class(protocol):
    class S:
        __slots__ = ("a",)

    desc, cls = rt_rebuilt((S.__dict__["a"], S), protocol)
    assert desc is cls.__dict__["a"] and type(desc) is types.MemberDescriptorType


def test_mappingproxy(protocol):
    mp = types.MappingProxyType({"some_key": "some value"})
    assert rt(mp, protocol) == mp and type(rt(mp, protocol)) is types.MappingProxyType


# WeakSet -----------------------------------------------------------------------------------
def test_weakset_members_keep_identity(protocol):
    class SomeClass:
        def __init__(self, x):
            self.x = x

    obj1, obj2, obj3 = SomeClass(1), SomeClass(2), SomeClass(3)
    weakset, d1, d2, d3 = rt([weakref.WeakSet([obj1, obj2]), obj1, obj2, obj3], protocol)
    assert (d1.x, d2.x, d3.x) == (1, 2, 3)
    assert len(weakset) == 2 and set(weakset) == {d1, d2}


# Files, loggers, singletons ---------------------------------------------------------------
def test_standard_streams(protocol, monkeypatch):
    assert rt(sys.stdout, protocol) is sys.stdout and rt(sys.stderr, protocol) is sys.stderr
    with open(os.devnull) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)  # pytest's own stdin is not a file
        with pytest.raises(pickling.UnpicklableError, match="standard input"):
            pickling.dumps(sys.stdin, protocol=protocol)


def test_text_file_open_for_reading_travels_as_a_snapshot(protocol, tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("Hello world!")
    with open(path) as f:
        f.seek(4)
        loaded = rt(f, protocol)
    assert isinstance(loaded, io.StringIO) and loaded.tell() == 4
    assert loaded.read() == "o world!" and loaded.name == str(path)
    with open(path, "w") as f, pytest.raises(pickling.UnpicklableError, match="not open for"):
        pickling.dumps(f, protocol=protocol)
    with pytest.raises(pickling.UnpicklableError, match="closed"):
        pickling.dumps(f, protocol=protocol)
    with open(path, "w+") as f:
        f.write("abc")
        f.seek(0)
        assert rt(f, protocol).read() == "abc"


def test_loggers_by_name(protocol):
    for logger in (logging.getLogger(), logging.getLogger("cadence.dummy_test_logger")):
        assert rt(logger, protocol) is logger


def test_singletons_and_their_types(protocol):
    singletons = [Ellipsis, NotImplemented, None, type(None), type(Ellipsis),
                  type(NotImplemented), types.FunctionType, types.CodeType]  # fmt: skip
    assert all(a is b for a, b in zip(rt(singletons, protocol), singletons))


def test_stateful_stdlib_objects(protocol):
    counter = itertools.count(1, step=2)
    next(counter)
    clone = rt(counter, protocol)
    assert [next(clone) for _ in range(3)] == [next(counter) for _ in range(3)]
    assert rt(int | str, protocol) == (int | str)


def test_numpy_ufunc_by_reference(protocol):
    np = pytest.importorskip("numpy")
    assert rt(np.add, protocol) is np.add


def test_container_subclasses_in_instance_state(protocol):
    class Box:
        def __init__(self):
            self.items = collections.OrderedDict(a=1, b=2)
            self.counts = collections.defaultdict(int, {"x": 3})
            self.tags = frozenset({"p", "q"})

    box = rt_rebuilt(Box(), protocol)
    assert list(box.items.items()) == [("a", 1), ("b", 2)]
    assert box.counts["x"] == 3 and box.counts["missing"] == 0
    assert box.tags == frozenset({"p", "q"})


def test_multiprocessing_lock_keeps_its_own_error(protocol):
    with pytest.raises(RuntimeError, match="only be shared between processes"):
        pickling.dumps(multiprocessing.Lock(), protocol=protocol)


# The Pickler itself ---------------------------------------------------------------------------
def test_dumps_keeps_no_reference_to_the_object():
    class MyClass:
        pass

    obj = MyClass()
    ref = weakref.ref(obj)
    pickling.dumps(obj)
    del obj
    gc.collect()
    assert ref() is None


def test_pickler_subclass_reducer_override_and_dispatch_table(protocol):
    class Token:
        pass

    class Other:
        pass

    class MyPickler(pickling.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, Token):
                return str, ("token",)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    p = MyPickler(buf, protocol=protocol)
    p.dispatch_table = {Other: lambda o: (int, (7,))}
    p.dump((Token(), Other(), lambda: 1))
    tok, other, fn = pickle.loads(buf.getvalue())
    assert (tok, other, fn()) == ("token", 7, 1)


def test_dump_load_file_every_protocol(tmp_path):
    def make(k):
        return lambda x: x + k

    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{proto}.pkl"
        with open(path, "wb") as fh:
            pickling.dump(make(proto), fh, protocol=proto)
        with open(path, "rb") as fh:
            assert pickling.load(fh)(1) == proto + 1
    assert pickling.DEFAULT_PROTOCOL == pickle.HIGHEST_PROTOCOL
    assert pickling.CloudPickler is pickling.Pickler  # cloudpickle's older name
    assert pickling.loads(pickling.dumps((1, 2))) == (1, 2)
