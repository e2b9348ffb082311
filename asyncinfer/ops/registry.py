"""The operator registry: ``(domain, op_type, since_version)`` → `Op` subclass.

Adding an op is one class plus one ``@register`` line. ``versions`` lists the ONNX schema
versions (``since_version`` values) the class implements; a model whose opset resolves to another
schema version of that op is refused with `UnsupportedOperatorError` naming the version,
rather than run with the wrong semantics.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..errors import UnsupportedOperatorError
from ..limits import DEFAULT_LIMITS, Limits
from .schema import normalise_domain as _normalise_domain
from .schema import schema_version

if TYPE_CHECKING:
    from ..model.ir import Layer
    from .base import Op

_REGISTRY: dict[tuple[str, str], dict[int, type["Op"]]] = {}


def register(op_type: str, versions: Iterable[int], domain: str = "") -> Callable[[type["Op"]], type["Op"]]:
    """Class decorator: register ``cls`` as the CPU reference kernel of ``op_type`` for ``versions``."""

    def decorate(cls: type["Op"]) -> type["Op"]:
        table = _REGISTRY.setdefault((_normalise_domain(domain), op_type), {})
        for v in versions:
            table[int(v)] = cls
        cls.op_type = op_type
        cls.domain = _normalise_domain(domain)
        return cls

    return decorate


def lookup(op_type: str, opset: int, domain: str = "") -> type["Op"]:
    """The class implementing ``op_type`` at model opset ``opset``; raises UnsupportedOperatorError."""
    domain = _normalise_domain(domain)
    table = _REGISTRY.get((domain, op_type))
    qualified = f"{domain}::{op_type}" if domain else op_type
    if not table:
        raise UnsupportedOperatorError([f"{qualified}: no implementation"])
    since = schema_version(op_type, opset, domain)
    if since is None:  # a domain onnx does not know: take the newest registration not after opset
        candidates = [v for v in table if v <= opset]
        if not candidates:
            raise UnsupportedOperatorError([f"{qualified} (opset {opset}): no implementation for this version"])
        return table[max(candidates)]
    if since not in table:
        known = ", ".join(str(v) for v in sorted(table))
        raise UnsupportedOperatorError(
            [f"{qualified} version {since} (model opset {opset}): not implemented (implemented versions: {known})"])
    return table[since]


def create(layer: "Layer", limits: Limits = DEFAULT_LIMITS) -> "Op":
    """Instantiate the kernel of ``layer``, bounded by ``limits`` (the model's) where it sizes
    tensors from data; raises UnsupportedOperatorError naming op, version and attribute."""
    cls = lookup(layer.op_type, layer.version, layer.domain)
    return cls(layer, limits)


def registered(builtin_only: bool = False) -> dict[tuple[str, str], list[int]]:
    """Every registered ``(domain, op_type)`` with the schema versions implemented.

    ``builtin_only`` leaves out ops registered from outside the asyncinfer package (plugins, tests).
    """
    return {key: sorted(table) for key, table in sorted(_REGISTRY.items())
            if not builtin_only or all(c.__module__.startswith("asyncinfer.") for c in table.values())}
