# Generated from solutions/03_training.py by `make build`. Do not edit.
"""minitorch.data: classification data generated on the spot (no downloads)."""
from __future__ import annotations

import numpy as np


def _class_sizes(n: int, k: int) -> np.ndarray:
    sizes = np.full(k, n // k)
    sizes[: n % k] += 1
    return sizes


def make_moons(n: int, noise: float = 0.1, rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaved half circles. -> X float32 (n, 2), y int64 (n,) in {0, 1}."""
    rng = rng if rng is not None else np.random.default_rng(0)
    n0, n1 = _class_sizes(n, 2)
    a0, a1 = rng.uniform(0, np.pi, n0), rng.uniform(0, np.pi, n1)
    upper = np.stack([np.cos(a0), np.sin(a0)], 1)
    lower = np.stack([1 - np.cos(a1), 0.5 - np.sin(a1)], 1)
    X = np.concatenate([upper, lower]) + noise * rng.standard_normal((n, 2))
    y = np.concatenate([np.zeros(n0), np.ones(n1)]).astype(np.int64)
    order = rng.permutation(n)
    X = (X - [0.5, 0.25]) / [0.9, 0.5]  # roughly centred, unit scale
    return X[order].astype(np.float32), y[order]


def make_spirals(n: int, noise: float = 0.2, rng: np.random.Generator | None = None,
                 classes: int = 3, turns: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """`classes` spiral arms, `turns` revolutions each. -> X float32 (n, 2), y int64 (n,)."""
    rng = rng if rng is not None else np.random.default_rng(0)
    Xs, ys = [], []
    for c, size in enumerate(_class_sizes(n, classes)):
        r = np.linspace(0.05, 1.0, size)
        theta = 2 * np.pi * (turns * r + c / classes) + noise * rng.standard_normal(size)
        Xs.append(np.stack([r * np.sin(theta), r * np.cos(theta)], 1))
        ys.append(np.full(size, c))
    order = rng.permutation(n)
    return np.concatenate(Xs)[order].astype(np.float32), np.concatenate(ys)[order].astype(np.int64)


def _arc(cx: float, cy: float, rx: float, ry: float, a0: float, a1: float, k: int = 10) -> list:
    a = np.linspace(a0, a1, k)
    return list(zip(cx + rx * np.cos(a), cy + ry * np.sin(a)))


# Stroke templates in a unit box (x right, y down): each digit is a list of polylines.
DIGIT_STROKES = {
    0: [_arc(0.5, 0.5, 0.28, 0.4, 0, 2 * np.pi, 14)],
    1: [[(0.32, 0.28), (0.55, 0.1), (0.55, 0.9)]],
    2: [_arc(0.5, 0.32, 0.25, 0.22, np.pi, 2.15 * np.pi, 8) + [(0.25, 0.9), (0.78, 0.9)]],
    3: [_arc(0.48, 0.3, 0.24, 0.2, 1.1 * np.pi, 2.5 * np.pi, 8), _arc(0.48, 0.7, 0.27, 0.2, 1.5 * np.pi, 2.9 * np.pi, 8)],
    4: [[(0.65, 0.9), (0.65, 0.1), (0.2, 0.65), (0.8, 0.65)]],
    5: [[(0.75, 0.1), (0.32, 0.1), (0.28, 0.45)] + _arc(0.48, 0.66, 0.27, 0.23, 1.25 * np.pi, 2.8 * np.pi, 9)],
    6: [[(0.68, 0.1), (0.4, 0.35)] + _arc(0.5, 0.68, 0.23, 0.22, 1.1 * np.pi, 3.1 * np.pi, 12)],
    7: [[(0.22, 0.1), (0.78, 0.1), (0.42, 0.9)]],
    8: [_arc(0.5, 0.3, 0.2, 0.2, 0, 2 * np.pi, 10), _arc(0.5, 0.7, 0.25, 0.2, 0, 2 * np.pi, 10)],
    9: [_arc(0.5, 0.32, 0.23, 0.22, 0, 2 * np.pi, 10) + [(0.73, 0.32), (0.6, 0.9)]],
}


def _segments(digit: int) -> np.ndarray:
    """(S, 2, 2) line segments (start, end) of a digit's strokes."""
    segs = [(line[i], line[i + 1]) for line in DIGIT_STROKES[digit] for i in range(len(line) - 1)]
    return np.array(segs, dtype=np.float64)


def make_digits(n: int, noise: float = 0.15, rng: np.random.Generator | None = None,
                size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Procedurally drawn digits. -> X float32 (n, size*size) in [0, 1], y int64 (n,) in 0..9.

    Each sample: the digit's strokes under a random affine map (rotation +-12 degrees, scale
    0.8-1.1, shear +-0.2, shift +-1 pixel), rendered with a random stroke width, plus Gaussian
    pixel noise of standard deviation `noise`, clipped to [0, 1].
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    y = rng.integers(0, 10, n).astype(np.int64)
    X = np.zeros((n, size * size), dtype=np.float64)
    centres = (np.stack(np.meshgrid(np.arange(size), np.arange(size)), -1).reshape(-1, 2) + 0.5) / size  # (P, 2) x, y
    for digit in range(10):
        idx = np.flatnonzero(y == digit)
        if idx.size == 0:
            continue
        k = idx.size
        angle = rng.uniform(-0.21, 0.21, k)
        scale = rng.uniform(0.8, 1.1, (k, 1))
        shear = rng.uniform(-0.2, 0.2, k)
        cos, sin = np.cos(angle), np.sin(angle)
        A = np.stack([np.stack([cos, -sin + shear], -1), np.stack([sin, cos], -1)], 1) * scale[:, :, None]  # (k, 2, 2)
        shift = rng.uniform(-1, 1, (k, 2)) / size
        segs = _segments(digit) - 0.5  # (S, 2, 2), centred
        pts = np.einsum("kij,spj->kspi", A, segs) + 0.5 + shift[:, None, None, :]  # (k, S, 2, 2)
        a, b = pts[:, :, 0, :], pts[:, :, 1, :]  # (k, S, 2)
        ab = b - a
        ap = centres[None, None, :, :] - a[:, :, None, :]  # (k, S, P, 2)
        t = np.clip((ap * ab[:, :, None, :]).sum(-1) / ((ab * ab).sum(-1)[:, :, None] + 1e-12), 0, 1)
        dist = np.linalg.norm(ap - t[..., None] * ab[:, :, None, :], axis=-1).min(axis=1)  # (k, P)
        width = rng.uniform(0.9, 1.4, (k, 1)) / size
        X[idx] = np.clip(1.5 - dist / width, 0, 1)
    X += noise * rng.standard_normal(X.shape)
    return np.clip(X, 0, 1).astype(np.float32), y


from minitorch.checks import Instance, NonNegative, Optional, Size, validate_public  # noqa: E402

# As optim's cell: only data's own functions (the notebook shares one namespace with nn), put back wrapped.
# (A hint is read in the namespace given, which holds no `np`: the rng rule is spelled out.)
_OWN = {"__name__": __name__, "make_moons": make_moons, "make_spirals": make_spirals, "make_digits": make_digits}
_RNG = Optional(Instance(np.random.Generator))
validate_public(_OWN, {
    "make_moons": {"n": Size, "noise": NonNegative, "rng": _RNG},
    "make_spirals": {"n": Size, "noise": NonNegative, "rng": _RNG, "classes": Size},
    "make_digits": {"n": Size, "noise": NonNegative, "rng": _RNG, "size": Size},
})
globals().update((name, fn) for name, fn in _OWN.items() if name != "__name__")
