"""The oracle comparison: relative error, FNV-1a and the tolerant digest."""

import numpy as np
import pytest

from scalelab.oracle.check import check_output, digest, fnv1a64, relative_error


@pytest.mark.parametrize(
    "data, expected",
    # Published FNV-1a 64-bit test vectors (Fowler/Noll/Vo reference code).
    [(b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"foobar", 0x85944171F73967E8)],
)
def test_fnv1a64_known_vectors(data, expected):
    assert fnv1a64(data) == expected


def test_relative_error_closed_form():
    ref = np.array([[3.0, 4.0]])  # ||ref|| = 5
    out = ref + np.array([[0.0, 0.5]])
    assert relative_error(out, ref) == pytest.approx(0.1)
    assert relative_error(ref, ref) == 0.0


def test_relative_error_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        relative_error(np.zeros((2, 3)), np.zeros((3, 2)))


def test_digest_equal_within_tolerance_and_different_beyond():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((16, 1000))
    close = ref * (1 + 1e-7 * rng.standard_normal(ref.shape))  # fp32-like rounding noise
    far = ref.copy()
    far[3] *= 1.5  # one item's output changed
    assert digest(close, 1e-5) == digest(ref, 1e-5)
    assert digest(far, 1e-5) != digest(ref, 1e-5)


def test_check_output_verdict():
    ref = np.ones((2, 4))
    good = check_output(ref + 1e-7, ref, 1e-5)
    bad = check_output(ref * 1.01, ref, 1e-5)
    assert good.passed and good.digest == good.reference_digest
    assert not bad.passed and bad.relerr == pytest.approx(0.01)
