"""The shared argument checks (``testbed.kernels.checks``)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.kernels.checks import check_array, check_finite, check_number, check_step


def test_check_number_accepts_and_converts():
    assert check_number("rate", 0.0, 1.0)(1) == 1.0 and isinstance(
        check_number("rate", 0.0, 1.0)(1), float)
    assert check_number("k", 1, 10, integer=True)(np.int64(3)) == 3
    assert check_number("ratio", 0.0, 1.0, lo_open=True)(1.0) == 1.0


@pytest.mark.parametrize("check,value,text", [
    (check_number("k", 1, 10, integer=True), 2.5, r"k: must be an integer in \[1, 10\]"),
    (check_number("k", 1, 10, integer=True), 11, "got 11"),
    (check_number("loss", 0.0, 1.0), True, "loss: must be a number"),
    (check_number("loss", 0.0, 1.0), float("nan"), "loss"),
    (check_number("loss", 0.0, 1.0), "0.5", "got '0.5'"),
    (check_number("ratio", 0.0, 1.0, lo_open=True), 0.0, r"ratio: must be a number in \(0.0"),
])
def test_check_number_names_the_setting(check, value, text):
    with pytest.raises(ValueError, match=text):
        check(value)


def test_other_checks_name_the_argument():
    with pytest.raises(ValueError, match="step"):
        check_step(-1)
    with pytest.raises(TypeError, match="q: expected dtype int32"):
        check_array("q", np.zeros(3, np.float32), np.int32)
    with pytest.raises(ValueError, match="x: must be contiguous"):
        check_array("x", np.zeros(6, np.float32)[::2], np.float32)
    x = np.zeros(4, np.float32)
    x[2] = np.inf
    with pytest.raises(ValueError, match="x: element 2 is inf; layout needs finite values"):
        check_finite("x", x, "layout needs finite values")
