"""What the text-generation tests share: a byte-level BPE tokenizer trained here on a few sentences
(no download), small enough for the tiny test decoders' 97-token vocabulary, and a decoder
folder (model.onnx + tokenizer.json + tokenizer_config.json) as exporters lay it out.

The tokenizer's alphabet is only the bytes of its training text, so every id below its
vocabulary decodes to something; multi-byte characters (accents, emoji, CJK) are split over
several tokens, and some merges end inside a character: what incremental detokenization must get
right.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import onnx

CORPUS = [
    "Hello world, héllo wörld! The quick brown fox jumps over the lazy dog.",
    "Emoji: 🤗🚀 and 日本語のテキスト, 中文 too.",
    "<|user|>hi there<|assistant|>ok</s>",
    "system: be brief. user: what? assistant: yes.",
    "hé hö hü " * 4,  # 'h' + the lead byte those share: a merge that ends inside a character
]
EOS = "</s>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def train_tokenizer(vocab_size: int = 97):
    """A byte-level BPE (GPT-2's scheme) trained on `CORPUS`, with ``</s>`` as its special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    return tokenizer


def decoder_folder(folder: Path, proto: onnx.ModelProto, *, chat_template: str | None = CHAT_TEMPLATE,
                   tokenizer=None) -> Path:
    """``folder/model.onnx`` with ``tokenizer.json`` and ``tokenizer_config.json`` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(folder / "model.onnx"))
    (tokenizer or train_tokenizer()).save(str(folder / "tokenizer.json"))
    config = {"eos_token": EOS, "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "model.onnx"


class Turnstile:
    """Stands in for a `Gate` event (``GATES[name]``): each run of the gate layer takes one
    permit, so a test lets exactly N model runs through, then the next one waits."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()

    def allow(self, runs: int = 1) -> None:
        for _ in range(runs):
            self._permits.release()

    def set(self) -> None:
        """Let every run through from now on (teardown)."""
        self._open.set()
        self._permits.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._open.is_set():
            return True
        if self._permits.acquire(timeout=timeout):
            if self._open.is_set():
                self._permits.release()  # pass it on to the next waiter
            return True
        return False
