"""Lesson 01: tensors. NumPy is the oracle: its strides, views (as_strided over the same
storage), broadcast_shapes and broadcast_to. Shapes are odd, include size-1 and size-0 axes,
and are drawn by hypothesis where a property holds for every shape."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

pytestmark = pytest.mark.lesson01

SMALL_SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


def elem_strides(a: np.ndarray) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def offset_of(view: np.ndarray, base: np.ndarray) -> int:
    """Element offset of view's first element inside base's buffer."""
    return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize


def strided(storage: np.ndarray, shape, strides, offset=0) -> np.ndarray:
    """NumPy's own strided view (the oracle), strides in elements."""
    return as_strided(storage[offset:], shape=shape, strides=tuple(s * storage.itemsize for s in strides))


# ---------------------------------------------------------------- 1.1 strides and offsets

@pytest.mark.exercise("1.1")
@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4), (5, 1, 3), (1, 1), (3, 7, 2, 5)])
def test_strides_for_matches_numpy(lesson, shape):
    a = np.empty(shape, dtype=np.float32)
    got = lesson.strides_for(shape)
    assert tuple(got) == elem_strides(a), f"strides_for({shape}): expected {elem_strides(a)}, got {got}"


@pytest.mark.exercise("1.1")
@settings(max_examples=40)
@given(shape=SMALL_SHAPES, data=st.data())
def test_index_to_offset_finds_every_element(lesson, shape, data):
    a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    strides = lesson.strides_for(shape)
    index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    got = lesson.index_to_offset(index, strides)
    assert got == a[index], f"index_to_offset({index}, {strides}): expected {a[index]}, got {got}"
    assert lesson.index_to_offset(index, strides, offset=17) == a[index] + 17, "the offset must be added"


@pytest.mark.exercise("1.1")
def test_index_to_offset_general_strides_and_errors(lesson):
    assert lesson.index_to_offset((2, 3), (1, -5), 30) == 30 + 2 - 15
    assert lesson.index_to_offset((4, 1), (0, 7)) == 7, "a stride of 0 ignores its index"
    with pytest.raises(ValueError):
        lesson.index_to_offset((1, 2, 3), (4, 1))


# ---------------------------------------------------------------- 1.2 gather

@pytest.mark.exercise("1.2")
@pytest.mark.parametrize("shape,strides,offset", [
    ((3, 5), (5, 1), 0),          # row-major
    ((5, 3), (1, 5), 0),          # its transpose
    ((2, 3, 4), (1, 2, 6), 1),    # column-major-ish with an offset
    ((4, 3), (0, 2), 3),          # a broadcast axis
    ((6,), (-2,), 12),            # reversed with a step
    ((3, 2, 2), (-4, 1, 5), 9),   # mixed signs
    ((0, 4), (4, 1), 0),          # empty
    ((), (), 5),                  # a scalar view
])
def test_gather_matches_as_strided(lesson, shape, strides, offset):
    storage = np.random.default_rng(1).standard_normal(31)
    got = lesson.gather(storage, shape, strides, offset)
    lo = offset + sum(min(0, s * (n - 1)) for n, s in zip(shape, strides))
    if lo < 0:  # as_strided cannot express a view that starts before its first element; compute by hand
        expected = np.array([storage[offset + sum(i * s for i, s in zip(idx, strides))]
                             for idx in itertools.product(*map(range, shape))]).reshape(shape)
    else:
        expected = strided(storage, shape, strides, offset)
    assert isinstance(got, np.ndarray) and got.shape == tuple(shape), f"expected an array of shape {shape}"
    assert got.dtype == storage.dtype, f"expected dtype {storage.dtype}, got {got.dtype}"
    np.testing.assert_array_equal(got, expected, err_msg=f"gather(shape={shape}, strides={strides}, offset={offset})")
    assert got.flags.c_contiguous and not np.shares_memory(got, storage), "gather must return a new contiguous array"


@pytest.mark.exercise("1.2")
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int64, np.bool_, np.complex64])
def test_gather_keeps_the_storage_dtype(lesson, dtype):
    """Not NumPy's default float64: np.empty(shape) would pass every float64 case above."""
    storage = (np.arange(31) % 5).astype(dtype)
    got = lesson.gather(storage, (2, 3), (1, 4), 2)
    assert isinstance(got, np.ndarray) and got.dtype == storage.dtype, (
        f"gather of a {np.dtype(dtype).name} storage must return {np.dtype(dtype).name}, got "
        f"{getattr(got, 'dtype', type(got).__name__)}")
    np.testing.assert_array_equal(got, strided(storage, (2, 3), (1, 4), 2))


@pytest.mark.exercise("1.2")
def test_gather_checks_bounds(lesson):
    storage = np.arange(10.0)
    for shape, strides, offset in [((3, 4), (4, 1), 0), ((5,), (-1,), 3), ((2,), (1,), 9)]:
        with pytest.raises(IndexError):
            lesson.gather(storage, shape, strides, offset)
    with pytest.raises(ValueError):
        lesson.gather(storage, (2, 3), (3,), 0)
    with pytest.raises(ValueError):
        lesson.gather(storage.reshape(2, 5), (2,), (1,), 0)


# ---------------------------------------------------------------- 1.3 views as stride arithmetic

@pytest.mark.exercise("1.3")
@pytest.mark.parametrize("shape,axes", [((2, 3, 4), (2, 0, 1)), ((5, 7), (1, 0)), ((3,), (0,)),
                                        ((2, 1, 3, 5), (3, 1, 0, 2))])
def test_transpose_layout_matches_numpy(lesson, shape, axes):
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    t = a.transpose(axes)
    got_shape, got_strides = lesson.transpose_layout(shape, elem_strides(a), axes)
    assert tuple(got_shape) == t.shape and tuple(got_strides) == elem_strides(t), \
        f"transpose {axes} of {shape}: expected {t.shape}, {elem_strides(t)}; got {got_shape}, {got_strides}"


@pytest.mark.exercise("1.3")
def test_transpose_layout_rejects_bad_axes(lesson):
    for axes in [(0, 0, 1), (0, 1), (0, 1, 3)]:
        with pytest.raises(ValueError):
            lesson.transpose_layout((2, 3, 4), (12, 4, 1), axes)


KEYS = [
    (slice(1, 4),),
    (slice(None, None, 2), 1),
    (-1, slice(None, None, -1)),
    (slice(5, 0, -2), slice(1, None, 3), 2),
    (2,),
    (slice(3, 3), slice(None)),       # empty
    (slice(-100, 100), -3, slice(None, None, -3)),
    (),
]


@pytest.mark.exercise("1.3")
@pytest.mark.parametrize("key", KEYS, ids=[str(k) for k in KEYS])
def test_slice_layout_matches_numpy(lesson, key):
    base = np.arange(7 * 5 * 6, dtype=np.float32)
    x = base.reshape(7, 5, 6)[1:, :, ::-1]  # a view with an offset and a negative stride
    x_off = offset_of(x, base)
    v = x[key]
    shape, strides, offset = lesson.slice_layout(x.shape, elem_strides(x), x_off, key)
    assert tuple(shape) == v.shape, f"x{key}: expected shape {v.shape}, got {shape}"
    assert tuple(strides) == elem_strides(v), f"x{key}: expected strides {elem_strides(v)}, got {strides}"
    if v.size:
        assert offset == offset_of(v, base), f"x{key}: expected offset {offset_of(v, base)}, got {offset}"
        np.testing.assert_array_equal(strided(base, shape, strides, offset), v)


@pytest.mark.exercise("1.3")
def test_slice_layout_errors(lesson):
    with pytest.raises(IndexError):
        lesson.slice_layout((3, 4), (4, 1), 0, (3,))
    with pytest.raises(IndexError):
        lesson.slice_layout((3, 4), (4, 1), 0, (0, -5))
    with pytest.raises(IndexError):
        lesson.slice_layout((3, 4), (4, 1), 0, (0, 0, 0))


@pytest.mark.exercise("1.3")
def test_is_contiguous_matches_numpy(lesson):
    a = np.zeros((4, 1, 6, 5), dtype=np.float64)
    views = [a, a[1:3], a[:, :, 2:], a[::2], a.transpose(0, 1, 3, 2), a[:, 0], a[2], a[:, :, :1, :],
             a[:1, :, :1, :1], a[:, :, ::-1], a[:, :, 3:3], np.zeros((3, 1)).T, np.zeros(7)[::2]]
    for v in views:
        got = lesson.is_contiguous(v.shape, elem_strides(v))
        assert got == v.flags.c_contiguous, \
            f"shape {v.shape} strides {elem_strides(v)}: expected {v.flags.c_contiguous}, got {got}"


# ---------------------------------------------------------------- 1.4 broadcast_shape

@pytest.mark.exercise("1.4")
@settings(max_examples=60)
@given(shapes=st.lists(st.lists(st.sampled_from([1, 1, 2, 3, 5, 0]), max_size=4).map(tuple), min_size=1, max_size=3))
def test_broadcast_shape_matches_numpy(lesson, shapes):
    try:
        expected = np.broadcast_shapes(*shapes)
    except ValueError:
        with pytest.raises(ValueError):
            lesson.broadcast_shape(*shapes)
        return
    got = lesson.broadcast_shape(*shapes)
    assert tuple(got) == expected, f"broadcast_shape{tuple(shapes)}: expected {expected}, got {got}"


@pytest.mark.exercise("1.4")
def test_broadcast_shape_examples_and_message(lesson):
    assert tuple(lesson.broadcast_shape((8, 1, 6), (7, 1))) == (8, 7, 6)
    assert tuple(lesson.broadcast_shape((3,), (4, 1), (2, 1, 1))) == (2, 4, 3)
    assert tuple(lesson.broadcast_shape()) == ()
    with pytest.raises(ValueError) as info:
        lesson.broadcast_shape((2, 3), (4,))
    msg = str(info.value)
    assert "(2, 3)" in msg and "(4,)" in msg, f"the error must name both shapes, got: {msg}"


# ---------------------------------------------------------------- 1.5 broadcast_strides

@pytest.mark.exercise("1.5")
@pytest.mark.parametrize("shape,target", [((3, 1), (2, 3, 4)), ((1,), (5,)), ((), (2, 3)), ((4, 3), (4, 3)),
                                          ((1, 5, 1), (3, 2, 5, 7)), ((1, 3), (0, 3))])
def test_broadcast_strides_match_broadcast_to(lesson, shape, target):
    base = np.random.default_rng(2).standard_normal(64)
    x = base[:2 * max(int(np.prod(shape)), 1)][::2][: int(np.prod(shape))].reshape(shape)  # stride-2 storage
    src_strides = elem_strides(x)
    got = lesson.broadcast_strides(shape, src_strides, target)
    assert len(got) == len(target), f"expected {len(target)} strides, got {got}"
    expected = np.broadcast_to(x, target)
    for n, s, e in zip(target, got, elem_strides(expected)):
        if n > 1:
            assert s == e, f"{shape} -> {target}: expected strides {elem_strides(expected)}, got {got}"
    np.testing.assert_array_equal(as_strided(x, target, tuple(s * 8 for s in got)), expected)


@pytest.mark.exercise("1.5")
def test_broadcast_strides_errors(lesson):
    # the last two go the wrong way: the target has size 1 where the array does not
    for shape, target in [((3,), (4,)), ((2, 3), (3,)), ((2, 3), (3, 3)), ((5, 3), (5, 1)), ((4,), (2, 1))]:
        with pytest.raises(ValueError) as info:
            lesson.broadcast_strides(shape, (1,) * len(shape), target)
        assert str(shape) in str(info.value) and str(target) in str(info.value), \
            f"the error must name {shape} and {target}, got: {info.value}"


# ---------------------------------------------------------------- 1.6 normalize_axis

@pytest.mark.exercise("1.6")
def test_normalize_axis_values(lesson):
    f = lesson.normalize_axis
    assert tuple(f(None, 3)) == (0, 1, 2)
    assert tuple(f(None, 0)) == ()
    assert tuple(f(-1, 4)) == (3,)
    assert tuple(f((2, -4), 4)) == (0, 2)
    assert tuple(f([-1, 0], 2)) == (0, 1)
    assert tuple(f(np.int64(1), 2)) == (1,)
    assert tuple(f((), 3)) == ()


AXES = st.one_of(st.none(), st.integers(-6, 5),
                 st.lists(st.integers(-6, 5), max_size=4).flatmap(lambda v: st.sampled_from([tuple(v), list(v)])))


@pytest.mark.exercise("1.6")
@settings(max_examples=80)
@given(axis=AXES, ndim=st.integers(0, 4))
def test_normalize_axis_matches_numpy(lesson, axis, ndim):
    """NumPy's own axis normalisation is the oracle (it keeps the order given; ours sorts)."""
    from numpy.lib.array_utils import normalize_axis_tuple

    try:
        expected = tuple(sorted(normalize_axis_tuple(range(ndim) if axis is None else axis, ndim)))
    except ValueError as exc:  # AxisError (out of range) and repeated axes are both ValueErrors
        with pytest.raises(ValueError) as info:
            lesson.normalize_axis(axis, ndim)
        assert not isinstance(info.value, np.exceptions.AxisError), \
            f"normalize_axis({axis!r}, {ndim}) should raise its own ValueError, not NumPy's AxisError"
        if isinstance(exc, np.exceptions.AxisError) and (isinstance(axis, int) or len(axis) == 1):
            bad = axis if isinstance(axis, int) else axis[0]
            assert str(bad) in str(info.value) and str(ndim) in str(info.value), \
                f"the error for axis {axis!r} with ndim={ndim} must name the axis and ndim, got: {info.value}"
        return
    got = lesson.normalize_axis(axis, ndim)
    assert tuple(got) == expected, f"normalize_axis({axis!r}, {ndim}): expected {expected}, got {got}"


@pytest.mark.exercise("1.6")
@pytest.mark.parametrize("axis", [1.0, True, "0", (0, 1.5), [0, None]])
def test_normalize_axis_rejects_non_integers(lesson, axis):
    with pytest.raises(TypeError) as info:
        lesson.normalize_axis(axis, 3)
    bad = axis if not isinstance(axis, (tuple, list)) else axis[1]
    assert repr(bad) in str(info.value) or str(bad) in str(info.value), \
        f"normalize_axis({axis!r}, 3): the TypeError must name the offending value {bad!r}, got: {info.value}"
    assert "iterable" not in str(info.value), f"raise your own message, not Python's: {info.value}"


@pytest.mark.exercise("1.6")
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, True), (-1, False), ((0, 2), False), ([2, 1], True)])
def test_reductions_with_your_normalize_axis(lesson, axis, keepdims):
    """Your normalize_axis as Tensor's sum/mean/max use it: the axes it returns, given to NumPy's
    reductions, reduce what NumPy's own axis argument reduces (Tensor comes in section 7, after
    this exercise's check cell)."""
    a = np.random.default_rng(3).standard_normal((3, 5, 4)).astype(np.float32)
    for name in ("sum", "mean", "max"):
        axes = lesson.normalize_axis(axis, a.ndim)
        got = getattr(np, name)(a, axis=axes, keepdims=keepdims)
        expected = getattr(np, name)(a, axis=None if axis is None else tuple(axis) if isinstance(axis, list) else axis,
                                     keepdims=keepdims)
        assert got.shape == np.shape(expected), f"{name}(axis={axis}, keepdims={keepdims}): shape {got.shape}"
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"{name}(axis={axis})")
    for bad, error in ((3, ValueError), (-4, ValueError), ((0, -3), ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error) as info:
            lesson.normalize_axis(bad, a.ndim)
        assert not isinstance(info.value, np.exceptions.AxisError) and "iterable" not in str(info.value), \
            f"normalize_axis({bad!r}, 3) must fail with your own message, got {type(info.value).__name__}: {info.value}"


# ---------------------------------------------------------------- 1.7 Tensor._binary

BINARY_SHAPES = [((3, 5), (3, 5)), ((3, 5), (5,)), ((4, 1, 3), (2, 3)), ((1,), (7, 1)), ((), (2, 3)), ((0, 3), (1, 3))]


@pytest.mark.exercise("1.7")
@pytest.mark.parametrize("sa,sb", BINARY_SHAPES)
def test_binary_ops_broadcast_like_numpy(lesson, sa, sb):
    rng = np.random.default_rng(4)
    a = rng.uniform(0.5, 2.0, sa).astype(np.float32)
    b = rng.uniform(0.5, 2.0, sb).astype(np.float32)
    ta, tb = lesson.Tensor(a), lesson.Tensor(b)
    cases = {"a + b": (ta + tb, a + b), "a - b": (ta - tb, a - b), "a * b": (ta * tb, a * b),
             "a / b": (ta / tb, a / b), "a ** b": (ta ** tb, a ** b)}
    for what, (got, expected) in cases.items():
        assert isinstance(got, lesson.Tensor), f"{what}: expected a Tensor, got {type(got).__name__}"
        assert got.shape == expected.shape, f"{what} with shapes {sa}, {sb}: expected {expected.shape}, got {got.shape}"
        assert got.dtype == np.float32, f"{what}: float32 inputs must give float32, got {got.dtype}"
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, err_msg=what)


@pytest.mark.exercise("1.7")
def test_binary_ops_with_scalars_and_reverse(lesson):
    a = np.random.default_rng(5).uniform(1, 2, (3, 4)).astype(np.float32)
    t = lesson.Tensor(a)
    cases = {"2 - t": (2 - t, 2 - a), "t - 2": (t - 2, a - 2), "3 / t": (3 / t, 3 / a), "2 ** t": (2 ** t, 2 ** a),
             "t ** 2": (t ** 2, a ** 2), "1.5 * t": (1.5 * t, 1.5 * a), "t + 1": (t + 1, a + 1)}
    for what, (got, expected) in cases.items():
        assert got.dtype == np.float32, f"{what}: a Python scalar must not promote float32, got {got.dtype}"
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, err_msg=what)
    arr = np.arange(4.0)
    np.testing.assert_allclose((t * arr).numpy(), a * arr, err_msg="an array operand is wrapped as a tensor")
    mixed = lesson.Tensor(np.arange(4, dtype=np.int64)) / lesson.Tensor(np.ones(4, dtype=np.float32))
    assert mixed.dtype == np.result_type(np.int64, np.float32), "dtypes promote as in NumPy"


@pytest.mark.exercise("1.7")
def test_numpy_scalars_and_arrays_on_either_side(lesson):
    """NumPy operands on the left reach the Tensor's reflected operators (not an object array);
    NumPy scalars act like Python numbers (PyTorch's rule): float32 stays float32."""
    a = np.random.default_rng(6).uniform(1, 2, (3, 4)).astype(np.float32)
    t = lesson.Tensor(a)
    two, arr, mat = np.float64(2.0), np.linspace(1, 2, 4, dtype=np.float32), np.ones((2, 3), np.float32)
    cases = {"np.float64(2) * t": (lambda: two * t, two * a.astype(np.float64)),
             "t * np.float64(2)": (lambda: t * two, a * 2.0),
             "np.float32(3) - t": (lambda: np.float32(3) - t, 3 - a),
             "t / np.sqrt(np.float64(4))": (lambda: t / np.sqrt(np.float64(4.0)), a / 2.0),
             "np.float64(2) ** t": (lambda: two ** t, 2.0 ** a.astype(np.float64)),
             "arr - t (float32 array on the left)": (lambda: arr - t, arr - a),
             "mat @ t (array on the left of @)": (lambda: mat @ t, mat @ a)}
    for what, (op, expected) in cases.items():
        got = op()
        assert isinstance(got, lesson.Tensor), (f"{what}: expected a Tensor, got {type(got).__name__} "
                                                f"(a NumPy scalar or array must not take over the operator)")
        assert got.dtype == np.float32, f"{what}: a float32 tensor must stay float32, got {got.dtype}"
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, err_msg=what)
    with pytest.raises(TypeError):
        np.exp(t)  # a NumPy function on a Tensor: a clear TypeError, not an object array


@pytest.mark.exercise("1.7")
def test_binary_shape_mismatch_names_both_shapes(lesson):
    ta, tb = lesson.Tensor(np.ones((2, 3))), lesson.Tensor(np.ones((4,)))
    for op in (lambda: ta + tb, lambda: ta * tb, lambda: tb - ta):
        with pytest.raises(ValueError) as info:
            op()
        msg = str(info.value)
        assert "(2, 3)" in msg and "(4,)" in msg, f"the error must name both shapes, got: {msg}"


@pytest.mark.exercise("1.7")
def test_binary_device_mismatch_names_both_devices(lesson):
    with lesson.use_backend("fakedev", lesson.Backend("numpy-again")):
        ta = lesson.Tensor(np.ones(3))
        tb = lesson.Tensor(np.ones(3), device="fakedev")
        for what, op in (("cpu + fakedev", lambda: ta + tb), ("fakedev - cpu", lambda: tb - ta),
                         ("fakedev * cpu", lambda: tb * ta), ("cpu ** fakedev", lambda: ta ** tb)):
            with pytest.raises(ValueError) as info:
                op()
            assert "cpu" in str(info.value) and "fakedev" in str(info.value), f"{what}: name both devices: {info.value}"
        out = tb * 2
        assert out.device == "fakedev", "the result lives on the operands' device"


@pytest.mark.exercise("1.7")
def test_binary_uses_the_backend_xp(lesson):
    """Arithmetic goes through backend.xp (so lesson 08's CuPy backend plugs in)."""
    import types

    calls = []

    def spy(name):
        fn = getattr(np, name)

        def wrapped(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)
        return wrapped

    fake_xp = types.SimpleNamespace(**{n: spy(n) for n in ("add", "subtract", "multiply", "divide", "power")},
                                    asarray=np.asarray)
    with lesson.use_backend("spy", lesson.Backend("spy", fake_xp)):
        t = lesson.Tensor(np.ones(3), device="spy")
        t + t
        2 * t
        t / 3
    assert calls == ["add", "multiply", "divide"], f"expected backend.xp add, multiply, divide; got {calls}"


@pytest.mark.exercise("1.7")
def test_binary_returns_subclass_instances(lesson):
    class Sub(lesson.Tensor):
        pass

    s = Sub(np.ones(2))
    assert type(s + 1) is Sub and type(1 - s) is Sub, "ops must return type(self) (lesson 02 subclasses Tensor)"
