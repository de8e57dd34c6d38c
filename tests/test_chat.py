"""A reply's one representation (model/chat.py): generated ids -> parts (re-rendered as trained) and the
display every front end shows (words once, calculator uses apart, no answer marker)."""
from __future__ import annotations

import pytest

from model.chat import ANSWER_MARKER, ReplyReader, ToolUse, cut_parts, display_words, read_reply, render

pytestmark = pytest.mark.timeout(60)

ARITHMETIC = [{"role": "user", "content": "What is 37 + 58?"},
              {"role": "assistant", "content": [{"type": "python", "text": "37 + 58"},
                                                {"type": "python_output", "text": "95"},
                                                {"type": "text", "text": "37 + 58 = 95"}]}]
WORD_PROBLEM = [{"role": "user", "content": "Maya has 12 apples and gets 30 more. How many now?"},
                {"role": "assistant", "content": [{"type": "text", "text": "We need "},
                                                  {"type": "python", "text": "12 + 30"},
                                                  {"type": "python_output", "text": "42"},
                                                  {"type": "text", "text": "12 + 30 = 42.\n#### 42"}]}]
LETTERS = [{"role": "user", "content": "How many 'r' in 'river'?"},
           {"role": "assistant", "content": [{"type": "python", "text": "'river'.count('r')"},
                                             {"type": "python_output", "text": "2"},
                                             {"type": "text", "text": "The letter 'r' appears 2 times in 'river'."}]}]


def reply_ids(tok, chat):
    """The ids a model that learned `chat` generates for its question (without the stop id)."""
    full, _ = render(tok, chat)
    prompt, _ = render(tok, chat[:-1], for_completion=True)
    assert full[:len(prompt)] == prompt and full[-1] == tok.special["<|assistant_end|>"]
    return prompt, full[len(prompt):-1]


@pytest.mark.parametrize("chat", [ARITHMETIC, WORD_PROBLEM, LETTERS,
                                  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]])
def test_ids_to_parts_to_ids(serve_tokenizer, chat):
    tok = serve_tokenizer
    prompt, ids = reply_ids(tok, chat)
    reply = read_reply(tok, ids)
    content = chat[-1]["content"]
    assert reply.parts == (content if isinstance(content, list) else [{"type": "text", "text": content}])
    again, _ = render(tok, chat[:-1] + [{"role": "assistant", "content": reply.parts}])
    assert again == prompt + ids + [tok.special["<|assistant_end|>"]]


def test_display_words_once_tool_uses_apart_no_marker(serve_tokenizer):
    tok = serve_tokenizer
    arithmetic, word_problem = (read_reply(tok, reply_ids(tok, c)[1]) for c in (ARITHMETIC, WORD_PROBLEM))
    assert arithmetic.words == "37 + 58 = 95" and arithmetic.tool_uses == [ToolUse("37 + 58", "95")]
    assert word_problem.words == "We need 12 + 30 = 42." and word_problem.tool_uses == [ToolUse("12 + 30", "42")]
    assert str(word_problem.tool_uses[0]) == "12 + 30 → 42"
    assert display_words(word_problem.parts) == word_problem.words


def test_streamed_pieces_in_order(serve_tokenizer):
    """Fed one id at a time, the reader shows the words as they come and each tool use once its
    result is in, in the order they happened."""
    tok = serve_tokenizer
    reader = ReplyReader(tok)
    shown = []
    for i in reply_ids(tok, WORD_PROBLEM)[1]:
        shown += reader.push(i)
    shown += reader.finish()
    use = shown.index(ToolUse("12 + 30", "42"))
    assert "".join(shown[:use]) == "We need " and "".join(shown[use + 1:]) == "12 + 30 = 42."
    assert sum(isinstance(s, str) for s in shown) > 5  # the words streamed
    assert not any(isinstance(s, str) and "#" in s for s in shown)


@pytest.mark.parametrize("text, words", [
    ("= 42.\n#### 42", "= 42."),
    ("= 42.\n#### 42\nand more", "= 42.\n#### 42\nand more"),  # not the last line: words, shown
    ("= 42.\n###", "= 42.\n###"),
    ("a\n\nb\n", "a\n\nb\n"),
    ("#### 42", "#### 42"),  # the marker is a final line after the reply's words
])
def test_answer_marker_only_as_the_last_line(text, words):
    assert ANSWER_MARKER == "\n#### "
    assert display_words([{"type": "text", "text": text}]) == words


def test_a_call_without_result_and_a_reply_cut_mid_call(serve_tokenizer):
    tok = serve_tokenizer
    s = tok.special
    call = [s["<|python_start|>"], *tok.encode("1/0"), s["<|python_end|>"]]
    reply = read_reply(tok, call + tok.encode("no idea"))  # the tool fed nothing back
    assert reply.tool_uses == [ToolUse("1/0", None)] and reply.words == "no idea"
    assert str(reply.tool_uses[0]) == "1/0 → (no result)"
    cut = read_reply(tok, tok.encode("Let me see ") + call[:-1])  # max_tokens ran out inside the call
    assert cut.words == "Let me see " and cut.tool_uses == [ToolUse("1/0", None)]
    assert cut.parts == [{"type": "text", "text": "Let me see "}, {"type": "python", "text": "1/0"}]


def test_other_control_ids_are_not_shown(serve_tokenizer):
    tok = serve_tokenizer
    reply = read_reply(tok, tok.encode("Hi") + [tok.special["<|user_start|>"]] + tok.encode(" there"))
    assert reply.words == "Hi there" and "<|" not in reply.words


def test_cut_parts_keeps_the_words_shown():
    parts = WORD_PROBLEM[1]["content"]
    assert cut_parts(parts, 4) == [{"type": "text", "text": "We n"}]
    assert cut_parts(parts, 10) == parts[:3] + [{"type": "text", "text": "12"}]
    assert display_words(cut_parts(parts, 10)) == "We need 12"
    assert cut_parts(parts, 1000) == parts


def test_reading_ids_in_batches_shows_what_one_at_a_time_shows(serve_tokenizer):
    """A front end reads a stream's new ids a few at a time (`read`): the same words, tool uses, parts and
    held-back answer line as `push` id by id, for replies with tool calls, an answer line, control ids and
    random ids (tokens that end inside a UTF-8 character)."""
    import random
    tok = serve_tokenizer
    rng = random.Random(0)
    replies = [reply_ids(tok, c)[1] for c in (ARITHMETIC, WORD_PROBLEM, LETTERS)]
    replies += [tok.encode("naïve café — 你好 ✓\n#### 7"), tok.encode("x\n####") + [tok.special["<|user_start|>"]]]
    replies += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]
    for ids in replies:
        one, shown_one = ReplyReader(tok), []
        for i in ids:
            shown_one += one.push(i)
        shown_one += one.finish()
        batched, shown_batched, k = ReplyReader(tok), [], 0
        while k < len(ids):
            n = rng.randint(1, 6)
            shown_batched += batched.read(ids[k:k + n])
            k += n
        shown_batched += batched.finish()
        assert joined(shown_batched) == joined(shown_one) and batched.parts == one.parts
        assert batched.words == one.words


def test_a_text_parts_text_is_what_the_tokenizer_decodes(serve_tokenizer):
    """Random plain ids read a few at a time (bytes that never make a character included): the reply's
    one text part holds the tokenizer's decode of them (joined from the pieces decoded for display)."""
    import random
    tok = serve_tokenizer
    rng = random.Random(0)
    plain = [i for i in range(tok.vocab_size) if i not in tok.special_ids]
    for _ in range(50):
        ids = [rng.choice(plain) for _ in range(rng.randint(1, 40))]
        reader, k = ReplyReader(tok), 0
        while k < len(ids):
            n = rng.randint(1, 6)
            reader.read(ids[k:k + n])
            k += n
        reader.finish()
        assert reader.parts == [{"type": "text", "text": tok.decode(ids)}]


def joined(shown: list) -> list:
    """Shown pieces with the words between two tool uses as one string."""
    out = []
    for s in shown:
        if isinstance(s, str) and out and isinstance(out[-1], str):
            out[-1] += s
        elif s != "":
            out.append(s)
    return out
