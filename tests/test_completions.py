"""POST /v1/completions and the chat extras (logprobs, penalties, logit_bias) through the real server,
driven by the official `openai` client; logprobs checked against the model's own forward."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from model.chat import render
from serve.api import Settings, create_app

pytestmark = pytest.mark.timeout(120)

TEXT = "Hello! How are you today?"
HI = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def server(serve_start, serve_model_dir):
    return serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False)))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@torch.no_grad()
def log_softmax(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def complete(client, **kw):
    kw.setdefault("model", "sparkchat")
    return client.completions.create(**kw)


def error_of(excinfo) -> dict:
    body = excinfo.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- /v1/completions ----

def test_text_prompt(client, serve_tokenizer):
    r = complete(client, prompt=TEXT, max_tokens=6, seed=1)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "sparkchat"
    c = r.choices[0]
    assert c.index == 0 and isinstance(c.text, str) and c.finish_reason == "length" and c.logprobs is None
    n_prompt = 1 + len(serve_tokenizer.encode(TEXT))  # <|bos|> + the text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)
    assert complete(client, prompt=TEXT, max_tokens=6, seed=1).choices[0].text == c.text  # seeded


def test_echo_logprobs_equal_a_direct_forward(client, serve_model, serve_tokenizer):
    """Scoring a text (max_tokens 0): every token's logprob is the model's log-softmax; the <|bos|> the
    server puts first is not echoed, so the text's first token is scored too."""
    r = complete(client, prompt=TEXT, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    ids = [serve_tokenizer.bos_id] + serve_tokenizer.encode(TEXT)
    ref = log_softmax(serve_model, ids)
    assert c.text == TEXT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == TEXT and len(lp.tokens) == len(ids) - 1
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs, start=1):
        best = ref[i - 1].topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_text_offsets_skip_the_special_ids_the_text_leaves_out(client, serve_tokenizer):
    """A reply of special ids (forced by logit_bias) shows no text: each token's text_offset stays at the
    end of the text before it (they counted the special token's name, which the text leaves out)."""
    user = serve_tokenizer.special["<|user_start|>"]
    c = complete(client, prompt=TEXT, max_tokens=3, echo=True, logprobs=1, logit_bias={str(user): 100}).choices[0]
    lp = c.logprobs
    assert c.text == TEXT and lp.tokens[-3:] == ["<|user_start|>"] * 3
    assert lp.text_offset[-3:] == [len(TEXT)] * 3


def test_token_id_prompts_as_lm_eval_sends_them(client, serve_model):
    """A batch of token-id prompts with echo, logprobs 1 and one greedy token: choice k*n + j is prompt
    k's j-th; the first prompt id has no logprob; the last entry is the generated token."""
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    r = complete(client, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0, n=2, seed=1234)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        ids = prompts[c.index // 2]
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = log_softmax(serve_model, ids)
        assert lp.token_logprobs[1:-1] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)
        # greedy: the generated token is the top one, with the same logprob
        assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 4
    single = complete(client, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert single.usage.prompt_tokens == 4


def test_stream_equals_the_whole_response(client):
    kw = dict(prompt=TEXT, max_tokens=8, seed=3, echo=True, logprobs=2)
    whole = complete(client, **kw).choices[0]
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts if p.logprobs for t in p.logprobs.tokens] == whole.logprobs.tokens
    assert [x for p in parts if p.logprobs for x in p.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [x for p in parts if p.logprobs for x in p.logprobs.text_offset] == whole.logprobs.text_offset
    assert [p.finish_reason for p in parts][-1] == "length" and chunks[-1].usage.completion_tokens == 8


def test_stop_strings_and_n(client):
    full = complete(client, prompt=TEXT, max_tokens=24, seed=11).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].isprintable()
                and "\ufffd" not in full[i:i + 2])
    r = complete(client, prompt=TEXT, max_tokens=24, seed=11, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    two = complete(client, prompt=[TEXT, "Numbers: 123"], max_tokens=4, n=2, seed=11)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.completion_tokens == 16
    assert two.choices[0].text == complete(client, prompt=TEXT, max_tokens=4, seed=11).choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),  # the deepest place the rule broke
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": [[1], [2, -1]]}, "prompt[1][1]"),
    ({"prompt": [[1], [2, 400]]}, "prompt[1]"),  # outside the vocabulary: the server names the prompt
    ({"prompt": [1.5]}, "prompt[0]"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),  # strict: an int, not a boolean
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"320": 5}}, "logit_bias"),
    ({"prompt": "x", "frequency_penalty": 9}, "frequency_penalty"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": ["x"] * 65}, "prompt"),
])
def test_completions_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "sparkchat", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_completions_context_and_model(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt=list(range(1, 129)), max_tokens=1)
    assert error_of(e)["code"] == "context_length_exceeded"
    whole = complete(client, prompt=list(range(1, 129)), max_tokens=0, echo=True, logprobs=0)
    assert len(whole.choices[0].logprobs.tokens) == 128  # the whole context can be scored
    with pytest.raises(openai.NotFoundError):
        complete(client, model="gpt-3.5-turbo-instruct", prompt="x")
    assert 'sparkchat_requests_total{status="400"}' in httpx.get(server.url + "/metrics").text


# ---- chat extras ----

def test_chat_logprobs_equal_a_direct_forward(client, serve_model, serve_tokenizer):
    r = client.chat.completions.create(model="sparkchat", messages=HI, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    prompt = render(serve_tokenizer, HI, for_completion=True)[0]
    assert len(content) == 6 and all(len(e.top_logprobs) == 3 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    # greedy: each token is its position's top one; rebuild the ids from the top entries' bytes
    gen = []
    for e in content:
        assert e.logprob == e.top_logprobs[0].logprob and e.bytes == e.top_logprobs[0].bytes
        gen.append(token_id(serve_tokenizer, e))
    ref = log_softmax(serve_model, prompt + gen)
    want = [float(ref[len(prompt) - 1 + k, t]) for k, t in enumerate(gen)]
    assert [e.logprob for e in content] == pytest.approx(want, abs=1e-4)
    plain = client.chat.completions.create(model="sparkchat", messages=HI, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_streamed_logprobs_equal_the_whole(client):
    kw = dict(model="sparkchat", messages=HI, max_tokens=10, seed=4, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def token_id(tok, entry) -> int:
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes(entry.bytes))


def test_chat_penalties_and_logit_bias_change_the_reply(client, serve_tokenizer):
    def reply(**kw):
        r = client.chat.completions.create(model="sparkchat", messages=HI, max_tokens=16, temperature=0,
                                           logprobs=True, **kw)
        return r.choices[0].message.content, [token_id(serve_tokenizer, e) for e in r.choices[0].logprobs.content]

    plain, ids = reply()
    assert reply(frequency_penalty=2.0)[0] != plain
    assert reply(presence_penalty=2.0)[0] != plain
    assert reply(logit_bias={str(ids[0]): -100})[1][0] != ids[0]  # banned: the reply starts otherwise
    assert reply(logit_bias={"100": 100})[1] == [100] * 16  # forced
