"""Text generation (``worker.generate_text``): incremental detokenization across multi-byte
characters and merged tokens, stop strings, the tokenizer's folder, and errors; on the tiny test
decoders with a byte-level BPE trained here (tests/text_testing.py, no download)."""
from __future__ import annotations

import importlib.util
import json

import pytest

import asyncinfer as ai
from asyncinfer.runtime.generation.text import REPLACEMENT, Detokenizer, StopText, TextTokenizer

pytest.importorskip("tokenizers", reason="the text extra's tokenizers package")

from runtime.test_generation import _idle, decoder, eventually  # noqa: E402 - after the skip
from text_testing import EOS, decoder_folder, train_tokenizer  # noqa: E402

TEXTS = ["héllo wörld", "Emoji: 🤗🚀 and 日本語のテキスト, 中文 too.", "🤗🤗 fox 🚀日本"]


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(train_tokenizer())


def _folder(tmp_path_factory, style: str, max_positions: int | None = None):
    extra = {} if max_positions is None else {"max_positions": max_positions}
    path = decoder_folder(tmp_path_factory.mktemp(style), decoder(style=style, seed=3, **extra))
    return path, ai.load_model(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A GPT-2-style decoder file with its tokenizer.json and tokenizer_config.json beside it."""
    return _folder(tmp_path_factory, "gpt2")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def both(request, tmp_path_factory, folder):
    """The GPT-2-style decoder folder, and a Llama-style one (rotary, grouped-query attention)."""
    return folder if request.param == "gpt2" else _folder(tmp_path_factory, "llama")


# -- incremental detokenization -----------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_of_split_characters_concatenate_to_the_whole_decoding(tokenizer, text):
    ids = tokenizer.encode(text)
    # the test means something: some tokens hold part of a character, alone they decode to U+FFFD
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.push(t) for t in ids] + [detokenizer.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)  # an incomplete character is held back, never shown
    assert "" in pieces[:-1]  # ...and some token did wait for the next one


def test_a_merged_token_that_ends_inside_a_character_is_held_until_it_completes(tokenizer):
    ids = tokenizer.encode("hé")
    tokens = [tokenizer.tokenizer.id_to_token(t) for t in ids]
    assert len(ids) == 2 and tokens[0] != "h"  # 'h' and the first byte of 'é', merged (see the assert above)
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.push(ids[0]) == ""
    assert detokenizer.push(ids[1]) == "hé"


def test_the_prompt_gives_the_first_token_its_context():
    """A SentencePiece-style decoder writes a word's leading space only after other text: decoding
    the new token alone would drop it. The pieces are the suffix of the whole decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 3,
                           trainers.BpeTrainer(vocab_size=60, show_progress=False))
    tokenizer = TextTokenizer(sp)
    prompt, rest = tokenizer.encode("the quick"), tokenizer.encode(" brown fox", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, prompt)
    pieces = [detokenizer.push(t) for t in rest] + [detokenizer.flush()]
    whole = tokenizer.decode(prompt + rest)
    assert whole == "the quick brown fox"
    assert "".join(pieces) == whole[len(tokenizer.decode(prompt)):] == " brown fox"


def test_stop_text_holds_back_only_what_may_begin_a_stop_string():
    stop = StopText(["END", "xy"])
    assert stop.push("abcE") == ("abc", False)   # 'E' may begin END
    assert stop.push("N") == ("", False)         # 'EN' still may
    assert stop.push("q") == ("ENq", False)      # not any more
    assert stop.push("x") == ("", False)
    assert stop.push("yz") == ("", True)         # stopped: nothing of 'xy' or after it
    other = StopText(["END"])
    assert other.push("aEN") == ("a", False) and other.flush() == "EN"
    assert StopText([]).push("anything") == ("anything", False)


# -- generate_text ---------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_generate_text_streams_the_decoding_of_generate(both, tokenizer):
    _, model = both
    prompt = "Emoji: 🤗 日本"
    async with ai.Worker(model, "cpu") as worker:
        ids = await worker.generate(tokenizer.encode(prompt), max_new_tokens=24).collect()
        stream = worker.generate_text(prompt, max_new_tokens=24)
        pieces = [piece async for piece in stream]
        assert stream.prompt_ids == tokenizer.encode(prompt)
        assert stream.token_ids == ids
        assert "".join(pieces) == stream.text == tokenizer.decode(ids)
        assert all(pieces) and stream.finish_reason is ai.FinishReason.LENGTH
        assert await worker.generate_text(prompt, max_new_tokens=24).collect() == tokenizer.decode(ids)
        # token ids as the prompt are used as they are
        assert await worker.generate_text(tokenizer.encode(prompt), max_new_tokens=24).collect() == \
            tokenizer.decode(ids)


def test_blocking_twin_and_iteration_on_a_thread(folder, tokenizer):
    _, model = folder
    with ai.Worker(model, "cpu") as worker:
        expected = tokenizer.decode(worker.generate_blocking(tokenizer.encode("héllo"), max_new_tokens=10))
        assert worker.generate_text_blocking("héllo", max_new_tokens=10) == expected
        assert "".join(worker.generate_text("héllo", max_new_tokens=10)) == expected


@pytest.mark.asyncio
async def test_a_stop_string_ends_the_stream_before_it(folder, tokenizer):
    _, model = folder
    async with ai.Worker(model, "cpu") as worker:
        full = await worker.generate_text("héllo", max_new_tokens=30).collect()
        at = next(i for i in range(2, len(full) - 1) if REPLACEMENT not in full[i:i + 2])
        stop = full[at:at + 2]
        stream = worker.generate_text("héllo", max_new_tokens=30, stop=[stop, "never in the text"])
        text = await stream.collect()
        assert text == full[:full.index(stop)]
        assert stream.finish_reason is ai.FinishReason.STOP
        await eventually(_idle(worker))  # the stream was cancelled: its cache is gone


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """The GPT-2-style decoder folder with a context of 1024 positions."""
    return _folder(tmp_path_factory, "gpt2", max_positions=1024)


@pytest.mark.asyncio
async def test_leaving_early_cancels_and_the_worker_stays_usable(long_folder):
    # (a stream that cannot end before the consumer leaves, by length or end of sequence: the
    # engine runs ahead of the consumer, and 60 tokens of a tiny model were done before a loaded
    # machine delivered the first piece of text)
    _, model = long_folder
    async with ai.Worker(model, "cpu") as worker:
        expected = await worker.generate_text("fox", max_new_tokens=8).collect()
        async with worker.generate_text("fox", max_new_tokens=1000, eos_token_id=()) as stream:
            async for _ in stream:
                break
        assert stream.finish_reason is ai.FinishReason.CANCELLED
        await eventually(_idle(worker))
        assert await worker.generate_text("fox", max_new_tokens=8).collect() == expected


def test_the_tokenizer_folder_gives_eos_special_tokens_and_chat_template(tmp_path, tokenizer):
    decoder_folder(tmp_path, decoder())
    loaded = TextTokenizer.load(tmp_path)
    eos = tokenizer.tokenizer.token_to_id(EOS)
    assert loaded.eos_token_ids == (eos,) and loaded.special_tokens["eos_token"] == EOS
    assert "add_generation_prompt" in loaded.chat_template
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 3]}))
    assert TextTokenizer.load(tmp_path / "tokenizer.json").eos_token_ids == (eos, 3)  # generation_config wins
    with ai.Worker(ai.load_model(tmp_path / "model.onnx")) as worker:
        ids = worker.generate_blocking(loaded.encode("fox"), max_new_tokens=12)
        cut = ids[4]  # an id that the model does generate: as eos, the stream ends before it
        assert worker.generate_text_blocking("fox", max_new_tokens=12, eos_token_id=cut) == \
            loaded.decode(ids[:ids.index(cut)])


def test_a_tokenizer_given_to_a_model_loaded_from_memory(tokenizer):
    proto = decoder()
    with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        with pytest.raises(ai.InputError, match="no tokenizer.json beside it.*pass tokenizer="):
            worker.generate_text("fox", max_new_tokens=3)
        ids = worker.generate_blocking(tokenizer.encode("fox"), max_new_tokens=5)
        for given in (tokenizer, tokenizer.tokenizer):  # a TextTokenizer or a tokenizers.Tokenizer
            assert worker.generate_text_blocking("fox", max_new_tokens=5, tokenizer=given) == tokenizer.decode(ids)


@pytest.mark.asyncio
async def test_bad_requests_are_clear_errors_and_the_worker_stays_usable(folder):
    _, model = folder
    async with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.InputError, match="stop must be a string or a list of strings"):
            worker.generate_text("fox", max_new_tokens=3, stop=[13])
        with pytest.raises(ai.InputError, match="stop holds an empty string"):
            worker.generate_text("fox", max_new_tokens=3, stop="")
        with pytest.raises(ai.InputError, match="tokenizer must be"):
            worker.generate_text("fox", max_new_tokens=3, tokenizer=42)
        stream = worker.generate_text("fox " * 200, max_new_tokens=3)  # errors of the prompt: at start()
        with pytest.raises(ai.InputError, match="more than the model's context of 64"):
            await stream.start()
        with pytest.raises(ai.InputError, match="max_new_tokens must be an integer >= 1"):
            await worker.generate_text("fox", max_new_tokens=0).collect()
        with pytest.raises(ai.InputError, match="encodes to no token"):
            await worker.generate_text("", max_new_tokens=3).collect()
        assert len(await worker.generate_text("fox", max_new_tokens=3).collect()) > 0


def test_a_failed_run_reaches_the_text_stream(tokenizer):
    proto = decoder(declare_vocab=False)  # no vocabulary declared: an id beyond the table reaches the Gather
    with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        stream = worker.generate_text([1, 500], max_new_tokens=4, tokenizer=tokenizer)
        with pytest.raises(ai.ExecutionError, match="Gather"):
            stream.collect_blocking()
        assert stream.finish_reason is ai.FinishReason.ERROR
        assert worker.generate_text_blocking("fox", max_new_tokens=2, tokenizer=tokenizer)


def test_without_the_tokenizers_package_the_error_names_the_extra(folder, monkeypatch):
    _, model = folder
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name, *a))
    with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.TokenizerUnavailableError, match=r"asyncinfer\[text\]") as info:
            worker.generate_text("fox", max_new_tokens=3)
        assert isinstance(info.value, ImportError) and isinstance(info.value, ai.AsyncInferError)
