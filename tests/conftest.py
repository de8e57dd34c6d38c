"""Shared test fixtures. Several engineers add fixtures here: append, and keep names prefixed by owner."""
from __future__ import annotations

import time

import pytest
import torch

# ---- serving fixtures: a tiny random chat model, trained and saved inside the test session ----

SERVE_TEXTS = [
    "Hello! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? It is 42. Numbers: 1234567890.",
    "Café, naïve, résumé; 你好世界; emoji 🙂 and 🚀 too.",
    "A small model that chats, streams and batches requests on one CPU.",
] * 4


def serve_tiny_model(vocab_size: int, seed: int = 0, stop_ids=()):
    """A 2-layer random GPT whose replies never end by themselves (the stop ids' head rows are zero,
    the others large), so generation length is set by max_tokens alone and sampling is peaked."""
    from model.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=vocab_size, n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=128)
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.blocks:  # non-zero residual outputs, so attention (and the cache) matter
            block.attn.c_proj.weight.copy_(torch.randn(block.attn.c_proj.weight.shape, generator=g) * 0.05)
            block.mlp.c_proj.weight.copy_(torch.randn(block.mlp.c_proj.weight.shape, generator=g) * 0.05)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.5)
        for i in stop_ids:
            model.lm_head.weight[i].zero_()
    return model.eval()


@pytest.fixture(scope="session")
def serve_tokenizer():
    from model.tokenizer import SparkTokenizer
    return SparkTokenizer.train(SERVE_TEXTS, vocab_size=320)


@pytest.fixture(scope="session")
def serve_model(serve_tokenizer):
    s = serve_tokenizer.special
    return serve_tiny_model(serve_tokenizer.vocab_size,
                            stop_ids=(s["<|assistant_end|>"], s["<|bos|>"], s["<|python_start|>"]))


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory, serve_model, serve_tokenizer):
    from model.model_dir import save_model_dir
    path = tmp_path_factory.mktemp("serve_model")
    save_model_dir(path, serve_model, serve_tokenizer,
                   {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "max_tokens": 16, "tool_use": True})
    return path


class _ServeThread:
    """A real uvicorn server for an app, in a thread, on a free loopback port."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def wait_healthy(self, timeout: float = 60.0) -> "_ServeThread":
        import time

        import httpx
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class SlowModel:
    """Wraps an engine's model so each forward first sleeps `delay` seconds: requests stay in flight long
    enough for a test to see them (the test_serve and test_ui_browser servers; `from conftest import`)."""

    def __init__(self, model, delay: float):
        self.model, self.delay = model, delay

    def __call__(self, *a, **kw):
        time.sleep(self.delay)
        return self.model(*a, **kw)


def post_large_prompts(url: str) -> list[str]:
    """Four 1 MB prompts posted at once to the server at `url`, one on each generation route (chat twice:
    as the user's message and as the system prompt), each far past any context and under the 1 MiB body
    limit; their error codes, as they came back."""
    import threading

    import httpx
    big = "word " * 200_000
    requests = [("/v1/chat/completions", {"model": "sparkchat", "messages": [{"role": "user", "content": big}]}),
                ("/v1/chat/completions", {"model": "sparkchat", "messages": [{"role": "system", "content": big},
                                                                               {"role": "user", "content": "Hi"}]}),
                ("/v1/completions", {"model": "sparkchat", "prompt": big}),
                ("/v1/responses", {"model": "sparkchat", "input": big})]
    codes: list[str] = []
    threads = [threading.Thread(target=lambda u=u, b=b: codes.append(
        httpx.post(url + u, json=b, timeout=60).json()["error"]["code"])) for u, b in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


class BrokenModel:
    """An engine's model failing at every forward: each request ends with the engine's 'error'."""

    def __call__(self, *a, **kw):
        raise RuntimeError("broken on purpose")


def broken_app(model_dir):
    """An app (no chat page) whose engine, in this process, fails every generation."""
    from serve.api import Settings, create_app
    from serve.runtime import Runtime

    def loader(metrics):
        rt = Runtime.in_process(model_dir, metrics, "cpu")
        rt.engine.model = BrokenModel()
        return rt
    return create_app(Settings(model_dir=model_dir, ui=False), loader=loader)


@pytest.fixture(scope="session")
def serve_start():
    """start(app, wait=True) -> a running server (.url, .app); all are stopped at the session's end."""
    servers = []

    def start(app, wait: bool = True):
        s = _ServeThread(app)
        servers.append(s)
        return s.wait_healthy() if wait else s

    yield start
    for s in servers:
        s.stop()


# ---- conversation fixtures: a tiny real model trained in the session to use the calculator ----

CONV_TOOL_CHATS = [  # the synthetic data's formats (pipeline/synthetic.py): arithmetic, word problem, chat
    [{"role": "user", "content": "What is 37 + 58?"},
     {"role": "assistant", "content": [{"type": "python", "text": "37 + 58"}, {"type": "python_output", "text": "95"},
                                       {"type": "text", "text": "37 + 58 = 95"}]}],
    [{"role": "user", "content": "Maya has 12 apples and gets 30 more. How many now?"},
     {"role": "assistant", "content": [{"type": "text", "text": "We need "}, {"type": "python", "text": "12 + 30"},
                                       {"type": "python_output", "text": "42"},
                                       {"type": "text", "text": "12 + 30 = 42.\n#### 42"}]}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you?"}],
]


@pytest.fixture(scope="session")
def conv_tool_chats():
    return CONV_TOOL_CHATS


def conv_learned_model(tok, rows: list[list[int]]):
    """A 2-layer GPT that has learned `rows` (rendered conversations) by heart: a few seconds of AdamW."""
    from model.gpt import GPT, GPTConfig
    width = max(map(len, rows)) - 1
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, ids in enumerate(rows):
        x[r, :len(ids) - 1], y[r, :len(ids) - 1] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=128))
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, f"the tiny model did not learn its chats (loss {loss.item():.3f})"
    return model.eval()


@pytest.fixture(scope="session")
def conv_tool_model_dir(tmp_path_factory, serve_tokenizer):
    """A 2-layer GPT that has learned CONV_TOOL_CHATS by heart: asked one of their questions greedily, it
    writes the calculator call, and the engine feeds the real result."""
    from model.chat import render
    from model.model_dir import save_model_dir
    model = conv_learned_model(serve_tokenizer, [render(serve_tokenizer, chat)[0] for chat in CONV_TOOL_CHATS])
    path = tmp_path_factory.mktemp("conv_tool_model")
    save_model_dir(path, model, serve_tokenizer, {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 40,
                                                  "tool_use": True})
    return path


# a client's function, a conversation that calls it and uses its result, one where it does not fit
CONV_FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}]
CONV_CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
CONV_CALL_CHATS = [
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": [{"type": "call", "text": CONV_CALL}]},
     {"role": "tool", "content": "21"}, {"role": "assistant", "content": "It is 21 in Paris."}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you?"}],
]


@pytest.fixture(scope="session")
def conv_call_model_dir(tmp_path_factory, serve_tokenizer):
    """A 2-layer GPT that has learned CONV_CALL_CHATS (with CONV_FUNCTIONS offered) by heart: asked for the
    weather in Paris greedily, it calls get_weather; given the result, it answers with it."""
    from model.chat import render
    from model.model_dir import save_model_dir
    rows = [render(serve_tokenizer, chat, tools=CONV_FUNCTIONS)[0] for chat in CONV_CALL_CHATS]
    path = tmp_path_factory.mktemp("conv_call_model")
    save_model_dir(path, conv_learned_model(serve_tokenizer, rows), serve_tokenizer,
                   {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 80, "tool_use": False})
    return path


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, serve_tokenizer):
    """A tiny random chat model with a context of 4096 tokens."""
    import torch

    from model.gpt import GPT, GPTConfig
    from model.model_dir import save_model_dir
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=serve_tokenizer.vocab_size, n_layer=1, n_embd=32, n_head=1, n_kv_head=1,
                          seq_len=4096))
    model.init_weights(seed=0)
    path = tmp_path_factory.mktemp("long_model")
    save_model_dir(path, model.eval(), serve_tokenizer, {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                         "max_tokens": 16, "tool_use": False})
    return path


# ---- engine fixtures ----

@pytest.fixture
def engine_factory():
    """`make(model, tool=None, **EngineConfig fields)`: a started Engine, shut down after the test."""
    from model.engine import Engine, EngineConfig
    engines = []

    def make(model, tool=None, **cfg):
        e = Engine(model, EngineConfig(**cfg), tool=tool)
        engines.append(e.start())
        return e

    yield make
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="session")
def serve_openai_client(serve_start, serve_model_dir):
    """The official openai client on a server of the session's tiny random model (no UI): for the tests
    whose replies a grammar shapes, whatever the model would write."""
    import openai

    from serve.api import Settings, create_app
    server = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False, device="cpu")))
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
