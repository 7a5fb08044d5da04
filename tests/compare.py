"""Exact comparison of vector-env outputs (observations, infos) for the equivalence tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_same(a: Any, b: Any, where: str = "value") -> None:
    """Assert ``a`` and ``b`` are identical: same structure, dtypes, shapes and values."""
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, tuple | list):
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{where}: ndarray vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} vs {b.shape}"
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a.flat, b.flat, strict=False)):
                assert_same(x, y, f"{where}[{i}]")
        else:
            assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where}: {a} vs {b}"
    elif isinstance(a, np.generic):
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert a == b or (a != a and b != b), f"{where}: {a} vs {b}"
    else:
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert a == b, f"{where}: {a!r} vs {b!r}"
