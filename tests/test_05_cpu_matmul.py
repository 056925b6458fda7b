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


# ---------------------------------------------------------------- access traces
# The point of 5.2, 5.3 and 5.6 is the order in which the loops touch memory. Numba compiles
# the same Python function the student wrote, and `kernel.py_func` is that function
# uncompiled: run it on arrays that log every element they hand out or receive, and the log
# is the kernel's access order.


class Traced:
    """A 2-D array, or a view into one, that logs each element access as (name, "r"|"w", (row, col))."""

    def __init__(self, base, name, log, ids=None):
        self.base, self.name, self.log = base, name, log
        self.ids = np.arange(base.size).reshape(base.shape) if ids is None else ids

    shape = property(lambda self: self.ids.shape)
    ndim = property(lambda self: self.ids.ndim)
    dtype = property(lambda self: self.base.dtype)

    def __len__(self):
        return self.ids.shape[0]

    def _where(self, i):
        return divmod(int(i), self.base.shape[1])

    def read_all(self):
        for i in self.ids.ravel():
            self.log.append((self.name, "r", self._where(i)))
        return self.base.flat[self.ids]

    def __array__(self, dtype=None, copy=None):  # NumPy arithmetic on a view reads all of it
        return self.read_all() if dtype is None else self.read_all().astype(dtype)

    def __getitem__(self, key):
        sub = self.ids[key]
        if np.ndim(sub) == 0:
            self.log.append((self.name, "r", self._where(sub)))
            return self.base.flat[int(sub)]
        return Traced(self.base, self.name, self.log, sub)

    def __setitem__(self, key, value):
        sub = self.ids[key]
        if isinstance(value, Traced) and value.base is self.base and np.array_equal(value.ids, sub):
            return  # c[i, :] += x: the in-place add on the view already wrote it
        value = value.read_all() if isinstance(value, Traced) else value
        for i in np.ravel(sub):
            self.log.append((self.name, "w", self._where(i)))
        self.base.flat[sub] = value

    def _inplace(self, op, other):
        self[...] = op(self.read_all(), other.read_all() if isinstance(other, Traced) else other)
        return self

    def __iadd__(self, other):
        return self._inplace(np.add, other)

    def __isub__(self, other):
        return self._inplace(np.subtract, other)


def trace(kernel, m, k, n, *extra, c_init=None):
    """Run kernel's uncompiled Python (kernel.py_func) on traced float64 operands a (m, k),
    b (k, n), c (m, n). Returns (log, a, b, c values after the call)."""
    rng = np.random.default_rng(m * 100 + n)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    c = np.zeros((m, n)) if c_init is None else c_init.copy()
    log = []
    fn = getattr(kernel, "py_func", kernel)
    fn(Traced(a, "a", log), Traced(b, "b", log), Traced(c, "c", log), *extra)
    return log, a, b, c


def updates(log):
    """The multiply-adds of an accumulating kernel, in order: each write of c[i, j] paired with
    the row p of the last read of b[:, j], as (i, p, j)."""
    last_b_row, out = {}, []
    for name, kind, (r, col) in log:
        if name == "b" and kind == "r":
            last_b_row[col] = r
        elif name == "c" and kind == "w":
            out.append((r, last_b_row.get(col), col))
    return out


def describe(seq, limit=6):
    return ", ".join(str(t) for t in seq[:limit]) + (", ..." if len(seq) > limit else "")


def check_ikj_order(got, m, k, n, what):
    everything = sorted((i, p, j) for i in range(m) for p in range(k) for j in range(n))
    assert sorted(got) == everything, (
        f"{what}: expected one update c[i, j] += a[i, p] * b[p, j] for each of the {len(everything)} triples "
        f"(i, p, j) of a ({m}, {k}) @ ({k}, {n}) product, found {len(got)} updates of c (does the kernel "
        f"accumulate in a local variable instead of updating c in the inner loop?)")
    if got != everything:
        bad = next(x for x, (g, e) in enumerate(zip(got, everything)) if g != e)
        raise AssertionError(f"{what}: the loops must run i, then p, then j innermost (i-k-j); update number {bad} "
                             f"was (i, p, j) = {got[bad]}, expected {everything[bad]}. First updates: "
                             f"{describe(got)}")


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


class CountingRow(list):
    """A row of a nested list that counts the elements read out of it."""

    reads = 0

    def __getitem__(self, i):
        CountingRow.reads += 1
        return super().__getitem__(i)

    def __iter__(self):
        for x in super().__iter__():
            CountingRow.reads += 1
            yield x


class CountingArray(np.ndarray):
    """An array whose tolist() gives rows that count their element reads."""

    def tolist(self):
        return [CountingRow(row) for row in np.asarray(self).tolist()]


@pytest.mark.exercise("5.1")
def test_python_loops_read_every_operand_pair(lesson):
    m, k, n = 5, 7, 6
    a, b = operands(m, k, n, np.float64)
    CountingRow.reads = 0
    c = lesson.matmul_python(a.view(CountingArray), b.view(CountingArray))
    assert_matmul(np.asarray(c), a, b, "matmul_python")
    assert CountingRow.reads >= 2 * m * n * k, (
        f"matmul_python read {CountingRow.reads} elements of the lists A and B; the three loops read a[i][p] and "
        f"b[p][j] for each of the {m * n * k} multiply-adds. Write the loops in Python (no NumPy product)")


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


@pytest.mark.exercise("5.2")
def test_ijk_loop_order(lesson):
    m, k, n = 4, 6, 5
    log, a, b, c = trace(lesson.ijk_kernel, m, k, n, c_init=np.full((m, n), 7.0))
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12, err_msg="ijk_kernel's uncompiled code (py_func)")
    pairs, last_a, pending_b = [], None, None
    for name, kind, (r, col) in log:  # pair each read of a[i, p] with the read of b[p, j] next to it
        if kind != "r" or name not in "ab":
            continue
        if name == "a":
            if pending_b and pending_b[0] == col:
                pairs.append((r, col, pending_b[1]))
                pending_b = None
            else:
                last_a = (r, col)
        elif last_a and last_a[1] == r:
            pairs.append((last_a[0], r, col))
            last_a = None
        else:
            pending_b = (r, col)
    expected = [(i, p, j) for i in range(m) for j in range(n) for p in range(k)]
    assert pairs == expected, (f"ijk_kernel must run i, then j, then p innermost (a dot product per c[i, j]); "
                               f"its multiply-adds went (i, p, j) = {describe(pairs)}")
    writes = [rc for name, kind, rc in log if name == "c" and kind == "w"]
    assert writes == [(i, j) for i in range(m) for j in range(n)], \
        f"ijk_kernel must write each c[i, j] once, after its dot product; its writes: {describe(writes)}"


@pytest.mark.exercise("5.3")
def test_ikj_loop_order(lesson):
    m, k, n = 5, 4, 7
    log, a, b, c = trace(lesson.ikj_kernel, m, k, n)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12, err_msg="ikj_kernel's uncompiled code (py_func)")
    check_ikj_order(updates(log), m, k, n, "ikj_kernel")


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
def test_choose_tile_is_exact_for_huge_caches(lesson):
    # isqrt(q) = 2**27 exactly, but the float sqrt of q = (2**27 + 1)**2 - 1 rounds up to 2**27 + 1
    q = (2**27 + 1) ** 2 - 1
    got = lesson.choose_tile(q * 24, 8, multiple=1)
    assert got == 2**27, (f"choose_tile({q * 24}, 8, multiple=1) should be {2**27}, got {got!r}: "
                          f"a float square root rounds up here; use math.isqrt")


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
@pytest.mark.parametrize("shape, tile", [((11, 13, 19), 4), ((9, 10, 7), 3)])
def test_tiled_kernel_blocks_by_tile(lesson, shape, tile):
    """Every (i, p, j) update belongs to one tile (i // T, p // T, j // T); a tiled kernel does
    all the updates of a tile together, in i-k-j order, before it moves to the next tile."""
    m, k, n = shape
    log, a, b, c = trace(lesson.tiled_kernel, m, k, n, tile)
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12, err_msg="tiled_kernel's uncompiled code (py_func)")
    got = updates(log)
    everything = sorted((i, p, j) for i in range(m) for p in range(k) for j in range(n))
    assert sorted(got) == everything, (
        f"tiled_kernel: expected one update c[i, j] += a[i, p] * b[p, j] per triple (i, p, j), "
        f"{len(everything)} in all, found {len(got)}")
    runs = []  # [tile, its updates] for each maximal run of updates in one tile
    for t in got:
        key = (t[0] // tile, t[1] // tile, t[2] // tile)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(t)
        else:
            runs.append([key, [t]])
    tiles = {key for key, _ in runs}
    if len(runs) != len(tiles):
        seen, again = set(), None
        for key, _ in runs:
            if key in seen:
                again = key
                break
            seen.add(key)
        raise AssertionError(
            f"tiled_kernel(tile={tile}) on a ({m}, {k}) @ ({k}, {n}) product must finish each {tile} x {tile} x {tile} "
            f"block before starting another, but it came back to block (i0, p0, j0) = "
            f"{tuple(x * tile for x in again)} after leaving it: {len(runs)} runs for {len(tiles)} blocks. Does it "
            f"use the `tile` argument for all three tile loops?")
    for key, ups in runs:
        if ups != sorted(ups):
            raise AssertionError(f"tiled_kernel: inside the block at (i0, p0, j0) = {tuple(x * tile for x in key)} the "
                                 f"loops must run i, p, j (j innermost); its updates went {describe(ups)}")


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
