"""Lesson 05's given code that no exercise test calls (minitorch.cpu_matmul): the machine's cache
sizes, the default tile derived from them, and matmul_tiled with that default. Small inputs; each
test checks what the function promises (and feeds the validation walk a call to replay)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import cpu_matmul


def test_machine_cache_sizes_reports_l1d_and_l2():
    sizes = cpu_matmul.machine_cache_sizes()
    assert {"L1d", "L2"} <= set(sizes), f"expected at least L1d and L2 (a fallback if unreadable), got {sizes}"
    assert all(isinstance(v, int) and v > 0 for v in sizes.values()), f"sizes must be positive ints, got {sizes}"


def test_default_tile_fits_three_tiles_in_l2():
    l2 = cpu_matmul.machine_cache_sizes().get("L2", cpu_matmul.FALLBACK_CACHES["L2"])
    for itemsize in (4, 8):
        tile = cpu_matmul.default_tile(itemsize)
        assert tile == cpu_matmul.choose_tile(l2, itemsize), f"default_tile({itemsize}) must be choose_tile(L2, {itemsize})"
        assert tile >= 1 and 3 * tile * tile * itemsize <= max(l2, 3 * itemsize), f"3 tiles of {tile}^2 must fit {l2} B"
    for bad in (0, -8):
        with pytest.raises(ValueError, match=rf"default_tile: itemsize .*{bad}"):
            cpu_matmul.default_tile(bad)
    with pytest.raises(TypeError, match="itemsize"):
        cpu_matmul.default_tile(8.5)


def test_matmul_tiled_default_tile():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((9, 7)), rng.standard_normal((7, 5)).astype(np.float32)
    c = cpu_matmul.matmul_tiled(a, b)
    assert c.dtype == np.float64 and c.shape == (9, 5)
    np.testing.assert_allclose(c, a @ b.astype(np.float64), rtol=1e-12, atol=1e-12)
