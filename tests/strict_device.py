"""A fake accelerator for the tests of lessons 02 and 03 (not a test file itself).

`StrictBackend()` is a minitorch Backend whose arrays (`DeviceArray`) are NumPy arrays that
refuse to be combined with host arrays (plain `np.ndarray`), as CuPy's arrays do. NumPy
functions and ufuncs applied to device arrays work and return device arrays (CuPy implements
NumPy's dispatch protocols too). So code that creates an array with `np.zeros(...)` where it
should use the backend's `xp.zeros_like(...)`, and then mixes the two, fails here with a clear
TypeError, without a GPU.

Test files get it from the `test_helper` fixture (tests/conftest.py): `test_helper("strict_device")`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minitorch.tensor import Backend

_HOST_OK = ("asarray", "array", "ascontiguousarray")  # the ways to copy host data to the device


class DeviceArray(np.ndarray):
    """An array 'on the device': works with NumPy's functions, refuses host arrays."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _refuse_host(ufunc.__name__, inputs + (out or ()))
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        return _device(getattr(ufunc, method)(*(_host(x) for x in inputs), **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        _refuse_host(func.__name__, _leaves(args) + _leaves(tuple(kwargs.values())))
        return _device(func(*_host(args), **{k: _host(v) for k, v in kwargs.items()}))


def _leaves(x: Any) -> tuple:
    if isinstance(x, (list, tuple)):
        return tuple(leaf for item in x for leaf in _leaves(item))
    return (x,)


def _refuse_host(what: str, values: tuple) -> None:
    for x in _leaves(values):
        if isinstance(x, np.ndarray) and not isinstance(x, DeviceArray):
            raise TypeError(f"{what}: a host NumPy array (shape {x.shape}, {x.dtype}) meets a device array; "
                            f"make arrays with the backend's array module (backend.xp.zeros_like, ...) or copy "
                            f"host data over with backend.asarray")


def _host(x: Any) -> Any:
    if isinstance(x, DeviceArray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    return x


def _device(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, DeviceArray):
        return x.view(DeviceArray)
    if isinstance(x, np.generic):  # CuPy gives 0-d device arrays where NumPy gives scalars
        return np.asarray(x).view(DeviceArray)
    if isinstance(x, tuple):
        return tuple(_device(v) for v in x)
    return x


class StrictXP:
    """The device's array module: NumPy's functions, returning device arrays."""

    def __getattr__(self, name: str) -> Any:
        obj = getattr(np, name)
        if isinstance(obj, (type, np.ufunc)) or not callable(obj):
            return obj  # dtypes, constants; ufuncs dispatch through DeviceArray.__array_ufunc__

        def call(*args, **kwargs):
            if name not in _HOST_OK:
                _refuse_host(f"xp.{name}", _leaves(args) + _leaves(tuple(kwargs.values())))
            return _device(obj(*_host(args), **{k: _host(v) for k, v in kwargs.items()}))

        return call


class StrictBackend(Backend):
    """A minitorch Backend for the fake device: register it with use_backend("strict", ...)."""

    def __init__(self):
        super().__init__("strict-numpy", StrictXP())

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.array(_host(a))


def device_array(x: Any, dtype: Any = None) -> DeviceArray:
    """Host data copied to the fake device."""
    return np.array(x, dtype=dtype).view(DeviceArray)
