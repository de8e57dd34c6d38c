"""A real browser (Debian's headless chromium via Playwright) chats on the Gradio page.

Skips itself when chromium or playwright is missing. Saves a screenshot under test-artifacts/.
"""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import SlowModel

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                               "(pip install playwright; no browser download needed)")


BROWSER_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    # hermetic, and no waiting on web fonts: every host but loopback fails to resolve at once
    # (request interception would buffer Gradio's event stream, so it is not used)
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


@contextmanager
def chat_page(url: str, width: int):
    """The chat page in a fresh headless chromium, loaded and ready: (page, its message box); the browser
    closes after. Screenshots go to ARTIFACTS."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": 800})
            page.goto(url + "/", wait_until="domcontentloaded")
            box = page.get_by_placeholder("Message sparkchat")
            box.wait_for(timeout=30_000)
            yield page, box.element_handle()  # a handle: the placeholder goes later
        finally:
            browser.close()


@pytest.fixture(scope="module")
def ui_server(serve_start, serve_model_dir):
    from serve.api import Settings, create_app
    from serve.runtime import Runtime

    def loader(metrics):  # 80 ms a token, so the reply visibly streams even on a busy machine
        rt = Runtime.in_process(serve_model_dir, metrics, "cpu", max_batch=4)
        rt.engine.model = SlowModel(rt.engine.model, 0.08)
        return rt

    return serve_start(create_app(Settings(model_dir=serve_model_dir), loader=loader))


def test_chat_page_streams_a_reply(ui_server):
    with chat_page(ui_server.url, 1100) as (page, box):
        stop = page.get_by_test_id("stop-button")

        def reply(message: str):
            """Send a message; the reply's element, the lengths its text had on the page, and whether
            the stop button showed while it was written."""
            box.fill(message)
            box.press("Enter")
            bot = page.locator(".message.bot:not(.pending)").last  # "pending" shows a loading label
            bot.wait_for(timeout=30_000)
            lengths, stop_seen = [], False
            deadline = time.time() + 20
            while time.time() < deadline:
                text = bot.inner_text()
                if text.strip() and (not lengths or len(text) != lengths[-1]):
                    lengths.append(len(text))
                stop_seen = stop_seen or stop.is_visible()
                if lengths and not stop.is_visible() and (stop_seen or len(lengths) >= 2):
                    break  # written
                time.sleep(0.05)
            return bot, lengths, stop_seen

        # the tiny random model sometimes answers in a few tokens, partly held back until they make
        # whole characters, which the page can show at one or two lengths only (CI saw [15, 17] and
        # [19]): up to three replies, for one long enough to be seen growing
        for _ in range(3):
            bot, lengths, stop_seen = reply("Hello! How are you today?")
            if len(lengths) >= 3:
                break
            page.get_by_label("Clear").first.click()
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
        final = bot.inner_text()

        # a second message, stopped mid-reply: the engine row is freed at once
        engine = ui_server.app.state.runtime.engine
        # 0.3 s a token: the reply's 16 tokens last about 5 s, for the click to land in on a busy machine
        delay, engine.model.delay = engine.model.delay, 0.3
        page.get_by_label("Clear").first.click()  # the tiny model's context holds one exchange
        box.fill("Tell me more.")
        box.press("Enter")
        stop.wait_for(timeout=30_000)
        deadline = time.time() + 20
        while engine.num_active == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert engine.num_active == 1
        # record (not replace) the engine's cancel, with whether the request had already finished:
        # a cancel of an unfinished request proves the stop button ended the reply, not the reply itself
        cancels, real_cancel = [], engine.cancel
        engine.cancel = lambda req: (cancels.append(not req.done), real_cancel(req))[1]
        try:
            stop.click()
            deadline = time.time() + 5
            while engine.num_active and time.time() < deadline:
                time.sleep(0.02)
            stopped_in = 5 - (deadline - time.time())
        finally:
            del engine.cancel
            engine.model.delay = delay
    assert final.strip(), "no reply appeared"
    assert len(lengths) >= 3, f"the reply did not stream (lengths seen: {lengths})"
    # the visible text grows; it may shrink by a few characters where the sampled text closes a
    # markdown pair (`*a*` renders as an italic "a"), but never restarts or loses what was shown
    assert lengths[-1] > lengths[0] and all(b >= a - 4 for a, b in zip(lengths, lengths[1:])), lengths
    assert stop_seen, "no stop button while the reply streamed"
    assert any(cancels), "the reply was not cancelled: it ended by itself before the stop button acted"
    assert stopped_in < 2, "the stop button did not free the engine row"


def test_a_tool_using_reply_and_the_next_turn(serve_start, conv_tool_model_dir, conv_tool_chats, serve_tokenizer):
    """The calculator use shows as a collapsed tool message, the words once (no answer marker, so no
    heading); the next turn's prompt holds the reply as the model wrote it."""
    from model.chat import render
    from serve.api import Settings, create_app
    from serve.runtime import Runtime
    server = serve_start(create_app(Settings(model_dir=conv_tool_model_dir),
                                    loader=lambda metrics: Runtime.in_process(conv_tool_model_dir, metrics, "cpu")))
    runtime = server.app.state.runtime
    prompts, open_stream = [], runtime.open_stream
    runtime.open_stream = lambda prompt, *a: (prompts.append(list(prompt)), open_stream(prompt, *a))[1]
    question, trained = conv_tool_chats[1]
    hello = {"role": "user", "content": "Hello!"}
    with chat_page(server.url, 1000) as (page, box):
        for turn, text in enumerate((question["content"], hello["content"]), 1):
            box.fill(text)
            box.press("Enter")
            deadline = time.time() + 30
            while (len(prompts) < turn or runtime.engine.num_active) and time.time() < deadline:
                time.sleep(0.05)
            page.get_by_test_id("stop-button").wait_for(state="hidden", timeout=30_000)
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "chat_page_tool.png"), full_page=True)
        chat = page.locator(".message-wrap")
        shown = chat.inner_text()
        headings = chat.locator("h1, h2, h3, h4, h5, h6").count()
        tool_header = page.get_by_text("12 + 30 → 42").count()
    assert "We need 12 + 30 = 42." in shown and "Calculator" in shown and tool_header == 1
    assert "####" not in shown and headings == 0 and "`" not in shown and "42`12" not in shown
    assert prompts[1] == render(serve_tokenizer, [question, trained, hello], for_completion=True)[0]
