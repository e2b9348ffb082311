"""Token generation from decoder models: ``worker.generate(...)`` streams token ids.

- `convention`: which decoder IO convention a model follows (names → inputs to feed).
- `sampling`: greedy / temperature / top-k / top-p selection, stop sequences.
- `stream`: `TokenStream`, the caller's async (or blocking) iterator of tokens.
- `engine`: the per-worker engine thread: continuous batching, the KV cache kept on the backend.
- `text`: text in, text out (``generate_text``): tokenizer, incremental detokenization, stop strings.
"""
from .convention import DecoderIO, detect
from .engine import GenerationEngine, GenerationStats
from .stream import FinishReason, TokenStream
from .text import TextStream, TextTokenizer, TokenizerSource, TokenizerUnavailableError

__all__ = ["DecoderIO", "FinishReason", "GenerationEngine", "GenerationStats", "TextStream", "TextTokenizer",
           "TokenStream", "TokenizerSource", "TokenizerUnavailableError", "detect"]
