"""merge_infos: per-server infos whose dtypes differ join losslessly (widened, as np.result_type
says: was, the first server's dtype won and the rest were cast into it, cutting strings and
rounding floats); only dtypes that cannot be promoted (strings and numbers) do not fit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from learner.batching import merge_infos


def test_strings_of_different_widths_join_whole() -> None:
    parts = [({"s": np.array(["ab", "cd"])}, 0, 2), ({"s": np.array(["abcdefgh", "x"])}, 2, 2)]
    infos = merge_infos(parts, 4)
    assert infos["s"].tolist() == ["ab", "cd", "abcdefgh", "x"]


def test_ints_then_floats_join_as_floats() -> None:
    parts = [
        ({"v": np.array([1, 2], dtype=np.int64), "_v": np.ones(2, dtype=bool)}, 0, 2),
        ({"v": np.array([0.5, 2.25]), "_v": np.ones(2, dtype=bool)}, 2, 2),
        ({"v": np.array([7], dtype=np.int32), "_v": np.ones(1, dtype=bool)}, 4, 1),
    ]
    infos = merge_infos(parts, 5)
    assert infos["v"].dtype == np.float64 and infos["v"].tolist() == [1.0, 2.0, 0.5, 2.25, 7.0]
    assert infos["_v"].dtype == np.bool_ and infos["_v"].all()


def test_nested_and_object_dtypes_widen_too() -> None:
    parts: list[tuple[dict[str, Any], int, int]] = [
        ({"d": {"n": np.array([3], dtype=np.int8)}}, 0, 1),
        ({"d": {"n": np.array([300], dtype=np.int64)}}, 1, 1),
        ({"o": np.array([1.5])}, 0, 1),
        ({"o": np.array([{"a": 1}], dtype=object)}, 1, 1),
    ]
    infos = merge_infos(parts, 2)
    assert infos["d"]["n"].tolist() == [3, 300]
    assert infos["o"].dtype == object and infos["o"].tolist() == [1.5, {"a": 1}]


def test_strings_and_floats_do_not_fit() -> None:
    parts = [({"s": np.array(["ab", "cd"])}, 0, 2), ({"s": np.array([1.0, 2.0])}, 2, 2)]
    with pytest.raises(ValueError, match=r"infos\['s'\]: dtype float64 here cannot join dtype <U2 before"):
        merge_infos(parts, 4)
    misfits: list[tuple[int, ValueError]] = []
    infos = merge_infos(parts, 4, misfits)
    assert [i for i, _ in misfits] == [1]
    assert infos["s"].tolist() == ["ab", "cd", "", ""]  # (nothing of the misfit written)
