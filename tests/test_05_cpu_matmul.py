"""Lesson 05: CPU matmul. NumPy (in float64) is the oracle; shapes are odd, prime, tall and
skinny, and not multiples of the tile size; inputs include non-contiguous views."""

import numpy as np
import pytest

pytestmark = pytest.mark.lesson05

# (m, k, n): 1x1, primes, tall/skinny, wide, an empty shared dimension.
SHAPES = [(1, 1, 1), (7, 13, 5), (31, 17, 43), (64, 1, 3), (1, 97, 1), (53, 8, 1), (3, 0, 4)]
TINY_SHAPES = [(1, 1, 1), (2, 3, 4), (5, 1, 3), (3, 7, 2), (3, 0, 4)]
DTYPES = [np.float32, np.float64]


def operands(m, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype))


def assert_matmul(c, a, b, what):
    """c must equal a @ b up to the rounding error of its dtype (|error| <= 4 k eps |a||b|)."""
    dtype = np.result_type(a, b)
    m, k = a.shape
    n = b.shape[1]
    assert isinstance(c, np.ndarray), f"{what}: expected a NumPy array, got {type(c).__name__}"
    assert c.shape == (m, n), f"{what}: expected shape {(m, n)}, got {c.shape}"
    assert c.dtype == dtype, f"{what}: expected dtype {dtype} (result dtype of the inputs), got {c.dtype}"
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64
    bound = 4 * max(k, 1) * np.finfo(dtype).eps * (np.abs(a64) @ np.abs(b64)) + 1e-300
    err = np.abs(c.astype(np.float64) - ref)
    if not np.all(err <= bound):
        i, j = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what}: wrong result for a {a.shape} @ b {b.shape} ({dtype}): "
                             f"C[{i}, {j}] = {c[i, j]!r}, expected {ref[i, j]!r}")


def noncontiguous(m, k, n, dtype, seed=1):
    """a: a strided slice of a bigger array; b: a transposed view. Neither is C-contiguous."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((2 * m + 1, 3 * k + 2)).astype(dtype)[1::2, 2::3]
    b = rng.standard_normal((n, k)).astype(dtype).T
    assert a.shape == (m, k) and b.shape == (k, n) and not a.flags.c_contiguous and not b.flags.c_contiguous
    return a, b


def check_errors(fn):
    """fn rejects bad input with a clear error (called after a correctness assertion)."""
    a, b = operands(3, 4, 5, np.float64)
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(5, 2\)"):
        fn(a, np.ones((5, 2)))
    with pytest.raises(ValueError, match="2-D"):
        fn(a[0], b)
    with pytest.raises(TypeError, match="int64"):
        fn(a, b.astype(np.int64))


# ---------------------------------------------------------------- 5.1 pure Python


@pytest.mark.exercise("5.1")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_python_matches_numpy(lesson, shape, dtype):
    a, b = operands(*shape, dtype)
    assert_matmul(lesson.matmul_python(a, b), a, b, "matmul_python")


@pytest.mark.exercise("5.1")
def test_python_noncontiguous_mixed_and_errors(lesson):
    a, b = noncontiguous(4, 5, 3, np.float64)
    assert_matmul(lesson.matmul_python(a, b), a, b, "matmul_python (non-contiguous inputs)")
    a, b = operands(3, 6, 2, np.float32)
    b = b.astype(np.float64)
    assert_matmul(lesson.matmul_python(a, b), a, b, "matmul_python (float32 @ float64 -> float64)")
    check_errors(lesson.matmul_python)


# ---------------------------------------------------------------- 5.2 / 5.3 Numba loop orders


@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("dtype", DTYPES)
def test_ijk_matches_numpy(lesson, dtype):
    for shape in SHAPES:
        a, b = operands(*shape, dtype)
        assert_matmul(lesson.matmul_ijk(a, b), a, b, "matmul_ijk")


@pytest.mark.exercise("5.2")
def test_ijk_kernel_overwrites_output(lesson):
    a, b = operands(9, 11, 7, np.float64)
    c = np.full((9, 7), 123.0)  # garbage in c must not leak into the result
    lesson.ijk_kernel(a, b, c)
    assert_matmul(c, a, b, "ijk_kernel(a, b, c) with c filled with 123.0 on entry")


@pytest.mark.exercise("5.2")
def test_ijk_noncontiguous_mixed_and_errors(lesson):
    a, b = noncontiguous(19, 23, 11, np.float32)
    assert_matmul(lesson.matmul_ijk(a, b), a, b, "matmul_ijk (non-contiguous inputs)")
    a, b = operands(5, 6, 7, np.float64)
    a = a.astype(np.float32)
    assert_matmul(lesson.matmul_ijk(a, b), a, b, "matmul_ijk (float32 @ float64 -> float64)")
    check_errors(lesson.matmul_ijk)


@pytest.mark.exercise("5.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_ikj_matches_numpy(lesson, dtype):
    for shape in SHAPES:
        a, b = operands(*shape, dtype)
        assert_matmul(lesson.matmul_ikj(a, b), a, b, "matmul_ikj")


@pytest.mark.exercise("5.3")
def test_ikj_kernel_accumulates(lesson):
    a, b = operands(9, 11, 7, np.float64)
    c0 = np.random.default_rng(5).standard_normal((9, 7))
    c = c0.copy()
    lesson.ikj_kernel(a, b, c)
    np.testing.assert_allclose(c, c0 + a @ b, rtol=1e-12, atol=1e-12,
                               err_msg="ikj_kernel must add a @ b into c (c += a @ b)")


@pytest.mark.exercise("5.3")
def test_ikj_noncontiguous_mixed_and_errors(lesson):
    a, b = noncontiguous(19, 23, 11, np.float64)
    assert_matmul(lesson.matmul_ikj(a, b), a, b, "matmul_ikj (non-contiguous inputs)")
    a, b = operands(5, 6, 7, np.float32)
    b = b.astype(np.float64)
    assert_matmul(lesson.matmul_ikj(a, b), a, b, "matmul_ikj (float32 @ float64 -> float64)")
    check_errors(lesson.matmul_ikj)


# ---------------------------------------------------------------- 5.4 cache sizes from sysfs


def fake_sysfs(root, entries):
    """Write index*/{level,type,size,...} files like /sys/devices/system/cpu/cpu0/cache."""
    for name, files in entries.items():
        d = root / name
        d.mkdir(parents=True)
        for f, value in files.items():
            (d / f).write_text(f"{value}\n")
    return root


@pytest.mark.exercise("5.4")
@pytest.mark.parametrize("text, expected", [("32K", 32768), ("1024K", 1048576), ("8M", 8388608),
                                            ("32768K\n", 33554432), (" 512 ", 512), ("2G", 2 * 1024**3)])
def test_parse_size(lesson, text, expected):
    got = lesson.parse_size(text)
    assert got == expected, f"parse_size({text!r}) should be {expected}, got {got!r}"


@pytest.mark.exercise("5.4")
@pytest.mark.parametrize("bad", ["", "K", "32KB", "3.5M", "lots"])
def test_parse_size_rejects(lesson, bad):
    assert lesson.parse_size("64K") == 65536, "parse_size('64K') should be 65536"
    with pytest.raises(ValueError):
        lesson.parse_size(bad)


@pytest.mark.exercise("5.4")
def test_cache_sizes_fake_sysfs(lesson, tmp_path):
    common = {"coherency_line_size": 64, "shared_cpu_list": "0"}
    root = fake_sysfs(tmp_path / "cache", {
        "index0": {"level": 1, "type": "Data", "size": "48K", "ways_of_associativity": 12, **common},
        "index1": {"level": 1, "type": "Instruction", "size": "32K", **common},
        "index2": {"level": 2, "type": "Unified", "size": "1280K", **common},
        "index3": {"level": 3, "type": "Unified", "size": "8M", **common},
        "index4": {"level": 4, "type": "Unified"},  # no size file: skipped
    })
    (root / "uevent").write_text("")  # not an index* directory: ignored
    got = lesson.cache_sizes(root)
    expected = {"L1d": 48 * 1024, "L1i": 32 * 1024, "L2": 1280 * 1024, "L3": 8 * 1024**2}
    assert got == expected, f"cache_sizes(fake sysfs) should be {expected}, got {got}"
    got = lesson.cache_sizes(str(root))
    assert got == expected, f"cache_sizes must accept a str path too; got {got}"


@pytest.mark.exercise("5.4")
def test_cache_sizes_other_root_and_missing(lesson, tmp_path):
    root = fake_sysfs(tmp_path / "cpu7", {
        "index0": {"level": 1, "type": "Data", "size": "64K"},
        "index1": {"level": 2, "type": "Unified", "size": "2048K"},
    })
    got = lesson.cache_sizes(root)
    assert got == {"L1d": 65536, "L2": 2 * 1024**2}, f"cache_sizes must read from its root argument; got {got}"
    missing = lesson.cache_sizes(tmp_path / "does-not-exist")
    assert missing == {}, f"cache_sizes on a missing directory should return {{}}, got {missing}"


# ---------------------------------------------------------------- 5.5 tile size


@pytest.mark.exercise("5.5")
@pytest.mark.parametrize("args, kwargs, expected", [
    ((32 * 1024, 8), {}, 32),          # isqrt(32768 // 24 = 1365) = 36 -> 32
    ((32 * 1024, 4), {}, 48),          # isqrt(2730) = 52 -> 48
    ((512 * 1024, 8), {}, 144),        # isqrt(21845) = 147 -> 144
    ((512 * 1024, 4), {}, 208),        # isqrt(43690) = 209 -> 208
    ((48 * 1024, 4), {}, 64),          # isqrt(4096) = 64 exactly
    ((32 * 1024, 8), {"n_tiles": 1}, 64),
    ((32 * 1024, 8), {"multiple": 1}, 36),
    ((32 * 1024, 8), {"multiple": 16}, 32),
    ((1024, 8), {}, 6),                # isqrt(42) = 6 < 8: unrounded
    ((16, 8), {}, 1),                  # nothing fits: at least 1
])
def test_choose_tile(lesson, args, kwargs, expected):
    got = lesson.choose_tile(*args, **kwargs)
    assert got == expected, f"choose_tile{args} with {kwargs} should be {expected}, got {got!r}"


@pytest.mark.exercise("5.5")
def test_choose_tile_rejects(lesson):
    assert lesson.choose_tile(24 * 64 * 64, 8) == 64
    for bad in [(0, 8), (-32768, 8), (32768, 0), (32768, -4)]:
        with pytest.raises(ValueError):
            lesson.choose_tile(*bad)


# ---------------------------------------------------------------- 5.6 tiled


@pytest.mark.exercise("5.6")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, tile", [
    ((37, 29, 53), 8),    # several tiles per dimension, ragged last tile in all three
    ((100, 33, 65), 16),
    ((17, 40, 24), 8),    # exact multiples in k and n, ragged m
    ((5, 7, 3), 64),      # tile bigger than the matrix
    ((6, 5, 4), 1),
    ((1, 61, 1), 7),
    ((3, 0, 4), 4),
])
def test_tiled_matches_numpy(lesson, shape, tile, dtype):
    a, b = operands(*shape, dtype)
    assert_matmul(lesson.matmul_tiled(a, b, tile=tile), a, b, f"matmul_tiled(tile={tile})")


@pytest.mark.exercise("5.6")
def test_tiled_kernel_accumulates(lesson):
    a, b = operands(21, 19, 23, np.float64)
    c0 = np.random.default_rng(6).standard_normal((21, 23))
    c = c0.copy()
    lesson.tiled_kernel(a, b, c, 8)
    np.testing.assert_allclose(c, c0 + a @ b, rtol=1e-12, atol=1e-12,
                               err_msg="tiled_kernel(a, b, c, 8) must add a @ b into c")


@pytest.mark.exercise("5.6")
def test_tiled_noncontiguous_mixed_and_errors(lesson):
    a, b = noncontiguous(41, 27, 35, np.float32)
    assert_matmul(lesson.matmul_tiled(a, b, tile=8), a, b, "matmul_tiled (non-contiguous inputs)")
    a, b = operands(13, 9, 11, np.float64)
    a = a.astype(np.float32)
    assert_matmul(lesson.matmul_tiled(a, b, tile=4), a, b, "matmul_tiled (float32 @ float64 -> float64)")
    check_errors(lambda x, y: lesson.matmul_tiled(x, y, tile=8))
    for bad in (0, -8, 2.5):
        with pytest.raises(ValueError, match="tile"):
            lesson.matmul_tiled(a, b, tile=bad)
