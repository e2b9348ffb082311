"""Which decoder IO convention a model follows, detected from its input and output names.

Two conventions are understood (the names the transformers/optimum exporters write, which
onnxruntime-genai's model builder also uses):

- **with past** (a KV cache): ``input_ids``, optional ``attention_mask`` and ``position_ids``,
  ``past_key_values.N.key`` / ``past_key_values.N.value`` (``[batch, heads, past, head_size]``)
  → ``logits`` and ``present.N.key`` / ``present.N.value`` (``present_key_values.N.*`` too).
  Optimum's merged decoders add a ``use_cache_branch`` flag: it is set when the past is not empty.
- **without past**: ``input_ids`` (optional ``attention_mask``, ``position_ids``) → ``logits``;
  every step recomputes the whole prefix (slow: documented).

A model with com.microsoft ``GroupQueryAttention`` layers (onnxruntime-genai's builder) is run with
the same names, one stream per run (its kernel reads ``seqlens_k`` from the mask, which left
padding would shift). Anything else gets an `InputError` naming what is missing.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import InputError
from ...model.ir import Model, TensorInfo

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^(?:present|present_key_values)\.(\d+)\.(key|value)$")
#: transformers config keys that give the context length, in the order they are trusted.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class CacheInput:
    """One ``past_key_values.N.key|value`` input, the output that continues it, and the fixed
    dims of its ``[batch, heads, past, head_size]`` shape."""

    name: str
    present: str
    heads: int
    head_size: int
    dtype: np.dtype


@dataclass(frozen=True)
class DecoderIO:
    """How to feed a decoder: the names it reads and writes, and what it allows."""

    input_ids: str
    ids_dtype: np.dtype
    attention_mask: str | None
    mask_dtype: np.dtype | None
    position_ids: str | None
    positions_dtype: np.dtype | None
    use_cache_branch: str | None
    cache: tuple[CacheInput, ...]        # empty: a model without past (recomputes the prefix)
    logits: str
    vocab_size: int | None               # the static last dim of logits, when declared
    max_context: int | None              # tokens the model can attend to, when it says so
    batchable: bool                      # several streams in one run (left padding)
    why_unbatched: str                   # when not batchable: why (shown in stats and docs)

    @property
    def has_past(self) -> bool:
        return bool(self.cache)


def _dtype(info: TensorInfo, default: type) -> np.dtype:
    return np.dtype(default) if info.dtype is None else np.dtype(info.dtype)


def detect(model: Model) -> DecoderIO:
    """The decoder convention of ``model``.

    Raises:
        InputError: the model fits no convention; the message names what is missing or extra.
    """
    inputs = {i.name: i for i in model.inputs}
    outputs = {o.name: o for o in model.outputs}
    problems: list[str] = []
    if "input_ids" not in inputs:
        problems.append(f"no input named 'input_ids' (inputs: {sorted(inputs)})")
    if "logits" not in outputs:
        problems.append(f"no output named 'logits' (outputs: {sorted(outputs)})")
    known = {"input_ids", "attention_mask", "position_ids", "use_cache_branch"}
    past = {n: m for n in inputs if (m := _PAST.match(n))}
    present = {(int(m.group(1)), m.group(2)): n for n in outputs if (m := _PRESENT.match(n))}
    extra = [n for n in inputs if n not in known and n not in past]
    if extra:
        problems.append(f"inputs no decoder convention fills: {extra} (understood: input_ids, attention_mask, "
                        "position_ids, past_key_values.N.key|value, use_cache_branch)")
    cache: list[CacheInput] = []
    for name, match in sorted(past.items(), key=lambda kv: (int(kv[1].group(1)), kv[1].group(2))):
        layer, kind = int(match.group(1)), match.group(2)
        out = present.get((layer, kind))
        if out is None:
            problems.append(f"input {name!r} has no matching output 'present.{layer}.{kind}'")
            continue
        shape = inputs[name].shape
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            problems.append(f"input {name!r} declares shape {shape}: generation needs [batch, heads, past, head_size] "
                            "with heads and head_size fixed, to build the empty cache of the first step")
            continue
        if isinstance(shape[2], int):
            problems.append(f"input {name!r} has a fixed past length {shape[2]} (a shared past/present buffer): "
                            "generate() needs a past that grows by the tokens of each step")
            continue
        cache.append(CacheInput(name, out, shape[1], shape[3], _dtype(inputs[name], np.float32)))
    if past and len(past) % 2:
        problems.append("the past_key_values inputs do not come in key/value pairs")
    if problems:
        raise InputError(f"model {model.name!r} does not fit a decoder convention for generate(): "
                         + "; ".join(problems))

    ids = inputs["input_ids"]
    if ids.shape is not None and (len(ids.shape) != 2 or isinstance(ids.shape[1], int)):
        raise InputError(f"model {model.name!r}: input 'input_ids' declares shape {ids.shape}; generate() needs "
                         "[batch, sequence] with a variable sequence length")
    mask = inputs.get("attention_mask")
    positions = inputs.get("position_ids")
    logits = outputs["logits"]
    vocab = logits.shape[-1] if logits.shape and isinstance(logits.shape[-1], int) else None
    gqa = any(layer.op_type == "GroupQueryAttention" for layer in model.layers)
    fixed_batch = isinstance(ids.shape[0], int) if ids.shape else False
    if fixed_batch:
        why = "its input_ids has a fixed batch size"
    elif mask is None:
        why = "it has no attention_mask input (left padding needs one)"
    elif positions is None:
        why = "it has no position_ids input (left padding would shift the positions it computes itself)"
    elif gqa:
        why = "its GroupQueryAttention layers read sequence lengths from the mask (no left padding)"
    else:
        why = ""
    return DecoderIO(
        input_ids="input_ids", ids_dtype=_dtype(ids, np.int64),
        attention_mask=None if mask is None else mask.name, mask_dtype=None if mask is None else _dtype(mask, np.int64),
        position_ids=None if positions is None else positions.name,
        positions_dtype=None if positions is None else _dtype(positions, np.int64),
        use_cache_branch="use_cache_branch" if "use_cache_branch" in inputs else None,
        cache=tuple(cache), logits="logits", vocab_size=vocab, max_context=max_context(model),
        batchable=not why, why_unbatched=why)


def max_context(model: Model) -> int | None:
    """The context length the model declares, if any: the rows of the position-embedding table
    that ``position_ids`` indexes (a constant read by a Gather), else the transformers
    ``config.json`` beside the model file."""
    for layer in model.layers:
        if (layer.op_type == "Gather" and len(layer.inputs) == 2 and layer.inputs[1] == "position_ids"
                and layer.inputs[0] in model.constants and int(layer.attrs.get("axis", 0)) == 0):
            return int(np.shape(model.constants[layer.inputs[0]])[0])
    try:
        config = Path(model.source).parent / "config.json"
        if model.source != "<memory>" and config.is_file():
            data = json.loads(config.read_text())
            for key in _CONTEXT_KEYS:
                if isinstance(data.get(key), int) and data[key] > 0:
                    return int(data[key])
    except (OSError, ValueError):  # an unreadable or malformed config says nothing
        pass
    return None
