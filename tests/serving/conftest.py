"""What the serving tests share: the anyio backends they run under, and a batchable model whose
one layer fails on the data of one request (a failure that belongs to that request alone)."""
from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.ops.base import Op
from asyncinfer.ops.registry import register
from conftest import TEST_DOMAIN, make_model, tensor_info


@register("FailOnNegative", versions=(1,), domain=TEST_DOMAIN)
class FailOnNegative(Op):
    """Identity that fails when any value is negative: a failure caused by one request's data."""

    def run(self, x):
        if (x < 0).any():
            raise ValueError("negative value")
        return x.copy()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def picky_model() -> ai.Model:
    """y = FailOnNegative(x) * 2 on [N, 3] float32 (batchable)."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    nodes = [helper.make_node("FailOnNegative", ["x"], ["checked"], domain=TEST_DOMAIN),
             helper.make_node("Mul", ["checked", "two"], ["y"])]
    return ai.load_model(make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])], [two]))
