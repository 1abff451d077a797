"""Detokenization and stop handling through the engine's own call sequence (``Sequence``, then
``append_token`` per sampled token), against whole-sequence ``tokenizer.decode``.

The regression cases come from a differential fuzzer: an unfinished character held back when
EOS or a stop token id ended the output was lost; a prompt ending in byte-fallback tokens lost
the first output token's leading space; a stop string completed by the flushed tail of a
sequence cut by max_model_len ended it before min_tokens.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_detokenizer import CORPUS  # the same multi-byte text trains the byte-level BPE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kiln.engine.sequence import Sequence
from kiln.sampling import IncrementalDetokenizer, SamplingParams

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def bytelevel() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def sentencepiece(decoder: str) -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral layout: <0xXX> byte tokens with byte_fallback, "▁" for spaces."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁Hi", "▁the", "▁end", "ok"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                               unk_token="<unk>", byte_fallback=True))
    if decoder == "llama2":
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="▁",
                                                            prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def byte_tokens(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])


def generate(tok, prompt, out, params, max_model_len=10**6):
    """Feed `out` as the engine does; returns (sequence, concatenated deltas)."""
    seq = Sequence("s", 0, list(prompt), params, (tok.eos_token_id,), max_model_len, tok)
    deltas = []
    for t in out:
        deltas.append(seq.append_token(t))
        if seq.finished:
            break
    return seq, "".join(deltas)


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("ender", ["eos", "stop_token_id"])
def test_unfinished_character_is_flushed_when_a_stop_token_ends_the_output(bytelevel, skip,
                                                                           ender):
    # fuzzer case: kiln-tiny out=[169, 249] with stop_token_ids=[249] gave '' (wants '\ufffd')
    body = bytelevel.encode("ok🎉")[:-1]  # the emoji's last byte never arrives
    end = bytelevel.eos_token_id if ender == "eos" else bytelevel.encode("x")[0]
    params = SamplingParams(max_tokens=20, skip_special_tokens=skip,
                            stop_token_ids=[end] if ender == "stop_token_id" else None)
    seq, streamed = generate(bytelevel, bytelevel.encode("hi"), body + [end], params)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None if ender == "eos" else end)
    # as a length finish at the same point would show it: the stop token's text is dropped
    assert seq.text == streamed == decode(bytelevel, body, skip) == "ok" + FFFD
    length, _ = generate(bytelevel, bytelevel.encode("hi"), body,
                         SamplingParams(max_tokens=len(body), skip_special_tokens=skip))
    assert length.text == seq.text


def test_flushed_tail_at_eos_can_complete_a_stop_string(bytelevel):
    body = bytelevel.encode("ok🎉")[:-1]
    params = SamplingParams(max_tokens=20, stop=["k" + FFFD])
    seq, streamed = generate(bytelevel, [], body + [bytelevel.eos_token_id], params)
    assert (seq.text, streamed, seq.finish_reason, seq.stop_reason) == ("o", "o", "stop",
                                                                        "k" + FFFD)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ids_text_is_kept_with_include_stop_str_in_output(bytelevel, include):
    # as vLLM: a stop token's own text is in the output when include_stop_str_in_output is set
    body, end = bytelevel.encode("ok"), bytelevel.encode("!")
    params = SamplingParams(max_tokens=20, stop_token_ids=end, include_stop_str_in_output=include)
    seq, streamed = generate(bytelevel, [], body + end, params)
    text = "ok!" if include else "ok"
    assert (seq.text, streamed, seq.finish_reason, seq.stop_reason) == (text, text, "stop",
                                                                        end[0])


def test_stop_string_in_flushed_tail_respects_min_tokens(bytelevel):
    # fuzzer case: max_model_len cut the output at 1 token, below min_tokens=3, and the
    # flushed U+FFFD matched stop="\ufffd": it finished "stop" before min_tokens
    prompt = bytelevel.encode("hi")
    body = bytelevel.encode("🎉")[:1]
    assert decode(bytelevel, body) == FFFD
    params = SamplingParams(max_tokens=5, min_tokens=3, stop=[FFFD])
    seq, streamed = generate(bytelevel, prompt, body, params, max_model_len=len(prompt) + 1)
    assert (seq.text, streamed, seq.finish_reason, seq.stop_reason) == (FFFD, FFFD, "length",
                                                                        None)


def test_stop_string_begun_before_min_tokens_ends_the_output(bytelevel):
    # "ST" within the first min_tokens tokens, "OP" after them: vLLM stops there, Kiln ran on
    head, rest = bytelevel.encode("x ST"), bytelevel.encode("OP and more")
    params = SamplingParams(max_tokens=40, min_tokens=len(head), stop=["STOP"])
    seq, streamed = generate(bytelevel, [], head + rest, params)
    assert (seq.text, streamed, seq.finish_reason, seq.stop_reason) == ("x ", "x ", "stop",
                                                                        "STOP")
    assert len(seq.output_token_ids) >= params.min_tokens


@pytest.mark.parametrize("decoder", ["llama2", "metaspace"])
@pytest.mark.parametrize("tail", ["🚀🚀", "中文", "é🙂"])
def test_prompt_ending_in_byte_tokens_keeps_the_first_leading_space(decoder, tail):
    # fuzzer case: a prompt ending in a character spelled with <0xXX> tokens puts the start of
    # the 5-token context inside an earlier character; ByteFallback then decodes the whole byte
    # run as U+FFFD, the context was discarded and " the end" streamed as "the end"
    tok = sentencepiece(decoder)
    prompt = tok.convert_tokens_to_ids(["<s>", "▁Hi", "▁"]) + byte_tokens(tok, tail)
    out = tok.convert_tokens_to_ids(["▁the", "▁end"])
    assert decode(tok, prompt).endswith(tail)
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add([t]) for t in out) + detok.flush()
    assert text == decode(tok, prompt + out)[len(decode(tok, prompt)):] == " the end"


@pytest.mark.parametrize("decoder", ["llama2", "metaspace"])
def test_prompt_ending_inside_a_byte_fallback_character(decoder):
    tok = sentencepiece(decoder)
    rocket = byte_tokens(tok, "🚀")
    prompt = tok.convert_tokens_to_ids(["▁Hi", "▁"]) + rocket[:2]  # stops mid-character
    out = rocket[2:] + tok.convert_tokens_to_ids(["▁the"])
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add([t]) for t in out) + detok.flush()
    assert text == decode(tok, out)  # no context: the stray bytes show as they decode alone


def expected(tok, out, params, num_prompt, max_model_len):
    """(tokens consumed, text, finish_reason, stop_reason) from whole decodes; byte-level BPE
    only, where decode(out[:k]) is the text of the first k tokens whatever the prompt."""
    stop, include, skip = params.stop, params.include_stop_str_in_output, \
        params.skip_special_tokens
    full = [decode(tok, out[:k], skip) for k in range(len(out) + 1)]
    shown = [""]  # what a streaming detokenizer has released: no unfinished character
    for text in full[1:]:
        shown.append(shown[-1] if text.endswith(FFFD) else text)
    # a stop string may begin anywhere but must end past the first min_tokens tokens' text
    checked_from = len(shown[params.min_tokens])

    def first_end(text, s):
        return text.find(s, max(checked_from - len(s) + 1, 0))

    def first_stop(text):
        hits = [(first_end(text, s) + len(s), first_end(text, s), s)
                for s in stop if first_end(text, s) >= 0]
        if not hits:
            return None
        end, start, s = min(hits)
        return text[:end if include else start], s

    def finish(k, text, reason, stop_reason):
        hit = first_stop(text) if k > params.min_tokens else None
        return (k, hit[0], "stop", hit[1]) if hit else (k, text, reason, stop_reason)

    for k in range(1, len(out) + 1):
        token = out[k - 1]
        if k >= params.min_tokens:
            kept = k if include else k - 1  # the stop token's own text, as vLLM
            if not params.ignore_eos and token == tok.eos_token_id:
                return finish(k, full[kept], "stop", None)
            if token in params.stop_token_ids:
                return finish(k, full[kept], "stop", token)
            hit = first_stop(shown[k])
            if hit:
                return k, hit[0], "stop", hit[1]
        if k >= params.max_tokens or num_prompt + k >= max_model_len:
            return finish(k, full[k], "length", None)
    raise AssertionError("the output must end within `out`")


@settings(max_examples=150, deadline=None, database=None)
@given(data=st.data())
def test_engine_call_sequence_matches_whole_decode(bytelevel, data):
    vocab = len(bytelevel)
    texts = ["café 中文 🙂🎉 done", "🚀🚀", "Héhé. 你好", "STOP now"]
    pieces = st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3),
                       st.sampled_from(texts).map(bytelevel.encode))
    out = [t for chunk in data.draw(st.lists(pieces, min_size=1, max_size=6)) for t in chunk]
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    skip = data.draw(st.booleans())
    text = decode(bytelevel, out, skip)
    substrings = st.builds(lambda a, n: text[a:a + n], st.integers(0, len(text)),
                           st.integers(1, 4)).filter(bool)
    stop = data.draw(st.lists(st.one_of(substrings, st.sampled_from([FFFD, "中", " ", "é"])),
                              max_size=3))
    max_tokens = data.draw(st.integers(1, len(out)))
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=data.draw(st.integers(0, min(3, max_tokens))),
        stop=stop, stop_token_ids=data.draw(st.lists(st.sampled_from(out), max_size=2)),
        ignore_eos=data.draw(st.booleans()), skip_special_tokens=skip,
        include_stop_str_in_output=data.draw(st.booleans()))
    max_model_len = len(prompt) + data.draw(st.integers(1, 2 * len(out)))
    seq, streamed = generate(bytelevel, prompt, out, params, max_model_len)
    got = (len(seq.output_token_ids), seq.text, seq.finish_reason, seq.stop_reason)
    assert streamed == seq.text
    assert got == expected(bytelevel, out, params, len(prompt), max_model_len)
