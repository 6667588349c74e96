"""A batch's products on oneDNN's packed weights (model.packed, issue 51 item 4): as exact as torch's own float32
product, judged against float64 on the shapes of SmolLM2's matrices, and packed again after a weight changes in place.
The batch loop's use of them (tokens and logits of every row against the row alone) is tests/test_batch.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmtrace.model.packed import K_BLOCK, PackedProducts, packed_products

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max())


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536)])
def test_packed_product_is_as_exact_as_torchs(n, k):
    # One running float32 sum over all K inputs (oneDNN's own kernel, unblocked) lands 2-4x farther from float64 than
    # torch's product does; blocks of 192 columns land where torch's does. The bound, 1.5x torch's own error on the
    # same numbers, is what the unblocked kernel fails.
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True)
    model = nn.Sequential(lin)
    x = torch.randn(16, k)
    with torch.no_grad():
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        plain = lin(x)
        with PackedProducts(model).active():
            packed = lin(x)
            packed_3d = lin(x.view(4, 4, k))
    assert packed.shape == plain.shape and packed_3d.shape == (4, 4, n)
    assert torch.equal(packed_3d.view(16, n), packed)  # the leading axes are only rows
    assert _error(packed, ref) <= 1.5 * _error(plain, ref)
    assert lin(x).equal(plain)  # off again after the block


def test_a_weight_changed_in_place_is_packed_again():
    torch.manual_seed(1)
    lin = nn.Linear(2 * K_BLOCK, 8, bias=False)
    products = PackedProducts(nn.Sequential(lin))
    x = torch.randn(3, 2 * K_BLOCK)
    with torch.no_grad():
        lin.weight.mul_(2)  # after packing
        with products.active():
            y = lin(x)
    assert torch.allclose(y, x @ lin.weight.detach().t(), atol=1e-5)


def test_what_is_not_packed():
    odd = nn.Linear(100, 8)  # 100 inputs: not whole blocks of 192, keeps torch's product
    products = PackedProducts(nn.Sequential(odd, nn.Linear(K_BLOCK, 8)))
    assert [m.in_features for m in products.linears] == [K_BLOCK]
    assert packed_products(nn.Sequential(nn.Linear(K_BLOCK, 8).to(torch.bfloat16))) is None  # float32 only
