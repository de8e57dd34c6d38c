"""Captures of how a conversation shows (issue 18): a calculator-using answer and a three-turn chat, on the
Gradio page (headless Chromium through Playwright: PNG screenshots and the page's text) and in
`sparkchat chat` (tmux capture-pane), plus the API's answer to the same question (JSON).

    python -m bench.conversation_capture --root . --out docs/img/conversation

`--root` is the checkout whose `artifacts/` (the model) and `reports/` (its eval scores, on the page's
model line) are shown; the server and the terminal chat run in a scratch directory that links to
them, so nothing is written there. Replies are greedy (temperature 0), so a re-run repeats them.
Needs Debian's chromium, the playwright package and tmux.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.stats import save_json
from sparkchat import paths

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
MAX_PNG = 300_000
# what the default model learned (pipeline/synthetic.py): a word problem solved with the calculator,
# then arithmetic and a capital, each asked with the earlier exchanges in the context
TOOL_QUESTION = "Maya has 12 apples and gets 30 more. How many apples does Maya have now?"
THREE_TURNS = [TOOL_QUESTION, "What is 345 - 78?", "What is the capital of France?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scratch_root(root: Path) -> Path:
    """A directory whose artifacts/ and reports/ are root's (read only through links)."""
    d = Path(tempfile.mkdtemp(prefix="sparkchat-capture-"))
    for name in (paths.ARTIFACTS, paths.REPORTS):
        (d / name).symlink_to((root / name).resolve())
    return d


def start_server(cwd: Path, model: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sparkchat", "serve", "--model", model, "--port", str(port)],
                            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy in 120 s")


def api_answer(url: str, question: str) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "sparkchat", "temperature": 0, "messages": [{"role": "user", "content": question}]})
    r.raise_for_status()
    return r.json()


def save_png(page, path: Path, **kw) -> None:
    """A screenshot under MAX_PNG bytes (reduced to a 64-colour palette when larger)."""
    page.screenshot(path=str(path), **kw)
    if path.stat().st_size > MAX_PNG:
        from PIL import Image
        Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)


def gradio_captures(url: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.goto(url + "/", wait_until="domcontentloaded")
            page.get_by_placeholder("Message sparkchat").wait_for(timeout=60_000)
            settings = page.get_by_text("Settings: system prompt, sampling")
            settings.click()  # greedy, so a re-run repeats the replies
            temperature = page.get_by_label("number input for Temperature")
            temperature.fill("0")
            temperature.press("Enter")
            settings.click()
            box = page.get_by_placeholder("Message sparkchat").element_handle()

            def ask(text: str) -> None:
                n = page.locator(".message-row.user-row").count()
                box.fill(text)
                box.press("Enter")
                page.locator(".message-row.user-row").nth(n).wait_for(timeout=30_000)
                page.get_by_test_id("stop-button").wait_for(state="hidden", timeout=60_000)
                page.wait_for_timeout(500)

            ask(TOOL_QUESTION)
            page.get_by_text("Calculator").first.click()  # open the tool message: the call and its result
            page.get_by_text("result:").first.wait_for(timeout=10_000)
            page.wait_for_timeout(1000)
            save_png(page, out / "gradio_tool_answer.png")
            (out / "gradio_tool_answer.txt").write_text(page.locator(".message-wrap").inner_text())
            page.get_by_label("Clear").first.click()
            page.set_viewport_size({"width": 1000, "height": 1250})  # the whole chat, unscrolled
            for text in THREE_TURNS:
                ask(text)
            save_png(page, out / "gradio_three_turns.png")
            (out / "gradio_three_turns.txt").write_text(page.locator(".message-wrap").inner_text())
        finally:
            browser.close()


def tmux_capture(cwd: Path, model: str, out: Path) -> None:
    """`sparkchat chat` in a 100x34 tmux pane, the three turns typed in; the pane as text and with its
    escapes (the dimmed calculator lines and notes)."""
    sock = f"sparkchat-capture-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    cmd = f"cd {cwd} && PYTHONPATH={ROOT} {sys.executable} -m sparkchat chat --model {model} --temperature 0"
    subprocess.run(tmux + ["new-session", "-d", "-s", "chat", "-x", "100", "-y", "34", cmd], check=True)

    def pane(*flags) -> str:
        return subprocess.run(tmux + ["capture-pane", "-p", *flags, "-t", "chat"], capture_output=True,
                              text=True, check=True).stdout

    def wait_prompt(n: int) -> None:  # n "> " prompts on screen: the last reply is complete
        deadline = time.time() + 120
        while sum(line.startswith("> ") or line == ">" for line in pane().splitlines()) < n:
            if time.time() > deadline:
                raise SystemExit("sparkchat chat did not answer in 120 s:\n" + pane())
            time.sleep(0.2)

    try:
        wait_prompt(1)
        for i, text in enumerate(THREE_TURNS, 2):
            subprocess.run(tmux + ["send-keys", "-t", "chat", "-l", text], check=True)
            subprocess.run(tmux + ["send-keys", "-t", "chat", "Enter"], check=True)
            wait_prompt(i)
        (out / "terminal_three_turns.txt").write_text(pane().rstrip() + "\n")
        (out / "terminal_three_turns.ansi").write_text(pane("-e").rstrip() + "\n")
    finally:
        subprocess.run(tmux + ["kill-server"], check=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="checkout holding artifacts/ and reports/ (default: .)")
    ap.add_argument("--model", default=str(paths.CHAT_MODEL), help="model directory under --root (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("docs/img/conversation"),
                    help="where the captures go (default: %(default)s)")
    args = ap.parse_args(argv)
    for tool in ("tmux", CHROMIUM):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is needed (apt-get install -y tmux chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    cwd = scratch_root(args.root)
    port = free_port()
    server = start_server(cwd, args.model, port)
    try:
        url = f"http://127.0.0.1:{port}"
        save_json(api_answer(url, TOOL_QUESTION), args.out / "api_tool_answer.json")
        gradio_captures(url, args.out)
    finally:
        server.terminate()
        server.wait(30)
    tmux_capture(cwd, args.model, args.out)
    shutil.rmtree(cwd)
    for f in sorted(args.out.iterdir()):
        print(f"{f}  {f.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
