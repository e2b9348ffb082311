"""What ONNX's own operator schemas say about an op: its schema version and attribute defaults.

Read from ``onnx.defs`` once per (domain, op_type, version) and cached, so no kernel restates a
default the standard already defines.
"""
from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

import onnx.defs

from ..model.attributes import attribute_value


def normalise_domain(domain: str) -> str:
    """``""`` for the default ONNX domain (also spelled ``"ai.onnx"``), else the domain itself."""
    return "" if domain in ("", "ai.onnx") else domain


@lru_cache(maxsize=None)
def _schema(op_type: str, opset: int, domain: str) -> Any:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # noqa: BLE001 - an op or domain onnx does not know
        return None


def schema_version(op_type: str, opset: int, domain: str = "") -> int | None:
    """The ``since_version`` of the schema ONNX uses for ``op_type`` at ``opset``, or None if unknown."""
    schema = _schema(op_type, opset, normalise_domain(domain))
    return None if schema is None else schema.since_version


#: Attribute defaults of ops whose schemas onnx does not ship (the ``com.microsoft`` domain,
#: from ONNX Runtime's operator documentation), by (domain, op_type): stated once, here, by the
#: module implementing the op (`declare_defaults`), never in its kernels.
_DECLARED_DEFAULTS: dict[tuple[str, str], Mapping[str, Any]] = {}


def declare_defaults(domain: str, op_type: str, defaults: Mapping[str, Any]) -> None:
    """Declare the attribute defaults of an op onnx has no schema for (a contrib domain's)."""
    _DECLARED_DEFAULTS[(normalise_domain(domain), op_type)] = MappingProxyType(dict(defaults))
    attribute_defaults.cache_clear()


@lru_cache(maxsize=None)
def attribute_defaults(op_type: str, opset: int, domain: str = "") -> Mapping[str, Any]:
    """The attributes with a default value in the schema ONNX uses for ``op_type`` at ``opset``
    (for ops onnx does not know: those declared with `declare_defaults`, else none). Read-only:
    shared by every layer of that op."""
    schema = _schema(op_type, opset, normalise_domain(domain))
    if schema is None:
        return _DECLARED_DEFAULTS.get((normalise_domain(domain), op_type), MappingProxyType({}))
    defaults = {}
    for name, attribute in schema.attributes.items():
        proto = attribute.default_value
        if proto is not None and proto.type != 0:  # 0: UNDEFINED, the attribute has no default
            defaults[name] = attribute_value(proto)
    return MappingProxyType(defaults)
