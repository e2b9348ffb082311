"""Fixtures of the runtime tests."""
from __future__ import annotations

import pytest

from pixel_testing import require_pixel


@pytest.fixture(params=["cpu", "gpu_pixel", "gpu_compute"])
def any_backend(request) -> str:
    """Each backend by name; a device backend this machine lacks skips, saying why."""
    if request.param == "gpu_pixel":
        require_pixel()
    if request.param == "gpu_compute":
        from asyncinfer.backends.cupy.device import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            pytest.skip(f"no gpu_compute backend on this machine: {reason}")
    return request.param
