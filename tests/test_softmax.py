import pytest
import torch

from models.softmax import get_softmax, softmax, softmax1


def test_softmax1_is_softmax_with_an_extra_zero_logit():
    x = torch.randn(5, 7, dtype=torch.float64) * 3
    padded = torch.cat([x, torch.zeros(5, 1, dtype=torch.float64)], dim=-1)
    expected = torch.softmax(padded, dim=-1)[:, :-1]
    torch.testing.assert_close(softmax1(x), expected)


def test_softmax1_hand_computed():
    x = torch.tensor([0.0, 1.0, 2.0])
    e = torch.exp(x)
    torch.testing.assert_close(softmax1(x), e / (1 + e.sum()))


def test_softmax1_rows_sum_below_one():
    x = torch.randn(100, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    s = softmax1(x).sum(-1)
    assert (s < 1).all() and (s > 0).all()
    torch.testing.assert_close(1 - s, 1 / (1 + torch.exp(x).sum(-1)))  # the rest is the mass on "nothing"
    # with one dominant logit the row sum approaches, but never reaches, 1
    assert softmax1(torch.tensor([50.0, 0.0])).sum() <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", [softmax, softmax1])
def test_no_nan_at_extremes(dtype, fn):
    big = torch.finfo(dtype).max
    rows = (
        torch.tensor(
            [
                [float("-inf")] * 4,  # fully masked
                [-big, -big, -big, -big],  # very negative
                [big, big, 0.0, -big],  # huge
                [1e4, -1e4, 3.0, float("-inf")],
                [-30000.0, -30001.0, -29999.0, -30000.0],
            ]
        )
        .clamp(min=-big, max=big)
        .to(dtype)
    )
    rows[0] = float("-inf")
    out = fn(rows, -1)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out >= 0).all() and (out.float().sum(-1) <= 1.0 + 1e-2).all()
    assert (out[0] == 0).all()  # a fully masked row attends to nothing


def test_softmax1_gradient_finite_for_masked_rows():
    x = torch.full((2, 3), float("-inf"))
    x[1] = torch.tensor([1.0, 2.0, 3.0])
    x.requires_grad_(True)
    softmax1(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_standard_softmax_matches_torch():
    x = torch.randn(4, 9)
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))


def test_unknown_softmax_name():
    with pytest.raises(ValueError, match="unknown softmax"):
        get_softmax("softmax2")
