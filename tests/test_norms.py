"""The squared norm (sdcguard.checks.norms) the comm hook records for checks 1a/1b: every gradient dtype, and where it overflows."""
import math

import pytest
import torch

from sdcguard.checks.norms import squared_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.complex64], ids=str)
def test_squared_norm_of_every_gradient_dtype(dtype):
    values = [3 + 4j, 0j] if dtype.is_complex else [3.0, 4.0]
    result = squared_norm(torch.tensor(values, dtype=dtype))
    assert result.dtype == torch.float64 and float(result) == 25.0


def test_non_contiguous_and_non_finite():
    assert float(squared_norm(torch.ones(4, 3).t())) == 12.0
    assert math.isnan(float(squared_norm(torch.tensor([1.0, float("nan")]))))
    assert math.isinf(float(squared_norm(torch.tensor([1.0, float("inf")]))))


def test_float32_accumulation_overflows_where_documented():
    # A finite float32 gradient with norm past ~1.8e19 reads as Inf (documented limit)...
    assert math.isinf(float(squared_norm(torch.tensor([2e19, 0.0]))))
    # ...and float64 gradients keep float64's range.
    assert float(squared_norm(torch.tensor([2e19, 0.0], dtype=torch.float64))) == pytest.approx(4e38)
