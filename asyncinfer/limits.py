"""``Limits``: every bound the engine puts on untrusted input, in one place.

A model file, an input and a request are untrusted. Each limit below is checked before the work it
guards is done (a file's size before it is read, a tensor's declared bytes before they are
allocated, a request body's length before it is parsed), and an exceeded limit raises a
`LimitExceededError` naming the limit, the value and the bound: ``ModelTooLargeError`` at
load (also a ``ModelLoadError``), ``RequestTooLargeError`` for inputs and requests (also an
``InputError``). ``docs/security.md`` describes the threat model these limits serve.

    limits = ai.Limits(max_nodes=10_000)
    model = ai.load_model(path, limits=limits)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import LimitExceededError, ModelTooLargeError, RequestTooLargeError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Bounds on untrusted models, inputs and requests. The defaults admit every real model.

    Model limits (checked by ``load_model``):

    Attributes:
        max_model_bytes: size of the model file (protobuf itself stops at 2 GiB).
        max_nodes: nodes in the graph, subgraphs of If/Loop/Scan included.
        max_graph_depth: nesting of subgraphs (a Loop in a Loop in an If is depth 3).
        max_tensor_rank: rank of any declared or computed tensor (NumPy allows 64).
        max_tensor_bytes: bytes of one initializer or Constant, inline or external.
        max_folded_bytes: bytes of one value built by constant folding at load; larger values
            (a small graph that folds to a huge constant: a "data-propagation bomb") are left to
            run time, where ``max_tensor_elements`` bounds them.

    Run limits (checked on every input and by kernels that size their output from data):

    Attributes:
        max_tensor_elements: elements of one input or of one tensor a kernel allocates from data
            (Expand, Tile, ConstantOfShape, Range, Resize, Pad, Reshape/Upsample targets…).
        max_image_pixels: pixels (width × height) of one image ImageDecoder decodes, checked on
            the image's header before any pixel is decoded ("decompression bombs": a few bytes
            that decode to gigabytes). The default, 8192 × 8192, is below the size at which
            Pillow itself warns.

    Request limits (checked by the server before a body is parsed):

    Attributes:
        max_request_bytes: body of one inference request (the server answers 413 above it).
        max_json_depth: nesting depth of a request's JSON (400 above it).
    """

    max_model_bytes: int = 2 * GiB
    max_nodes: int = 1_000_000
    max_graph_depth: int = 32
    max_tensor_rank: int = 32
    max_tensor_bytes: int = 4 * GiB
    max_folded_bytes: int = 1 * GiB
    max_tensor_elements: int = 1 << 31
    max_image_pixels: int = 8192 * 8192
    max_request_bytes: int = 256 * MiB
    max_json_depth: int = 32

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{field.name} must be a positive integer, got {value!r}")

    def replace(self, **changes: int) -> Limits:
        """A copy with some limits changed: ``ai.Limits().replace(max_nodes=100)``."""
        return dataclasses.replace(self, **changes)

    # -- checks ------------------------------------------------------------------------------
    def check_model(self, name: str, value: int, what: str) -> None:
        """Raise ``ModelTooLargeError`` if ``value`` exceeds the limit ``name`` (``what`` says where)."""
        bound = getattr(self, name)
        if value > bound:
            raise ModelTooLargeError(name, value, bound, what)

    def check_request(self, name: str, value: int, what: str) -> None:
        """Raise ``RequestTooLargeError`` if ``value`` exceeds the limit ``name``."""
        bound = getattr(self, name)
        if value > bound:
            raise RequestTooLargeError(name, value, bound, what)

    def check_shape(self, shape: tuple[int, ...], what: str) -> None:
        """Rank and element count of a tensor about to be accepted or allocated at run time."""
        self.check_request("max_tensor_rank", len(shape), what)
        count = 1
        for d in shape:
            count *= max(int(d), 0)
        self.check_request("max_tensor_elements", count, what)


DEFAULT_LIMITS = Limits()

__all__ = ["Limits", "DEFAULT_LIMITS", "LimitExceededError", "ModelTooLargeError", "RequestTooLargeError"]
