"""The chat widget as a user meets it, on the scheduler's demo page in headless Chromium:
one advisory per turn, before the request and never with the draft's text; clearing or
abandoning a draft invalidates it; answers stream in and match a fresh recompute; the
session's KV is reused on the next turn (the status line says so); errors show; stop,
edit, regenerate and a reload behave; model output never becomes HTML."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.conftest import ARTIFACTS
from tests.cluster import Cluster

PAGE = "/?temperature=0&max_tokens=24&abandon_ms=1500"


class Chat:
    """A page with the widget, and every request it made."""

    def __init__(self, page: Any, cluster: Cluster) -> None:
        self.page, self.cluster = page, cluster
        self.requests: list[tuple[str, str, str]] = []
        page.on("request", lambda r: self.requests.append((r.method, r.url, r.post_data or "")))

    def calls(self, method: str, path: str) -> list[tuple[int, str]]:
        return [(i, body) for i, (m, url, body) in enumerate(self.requests)
                if m == method and path in url]

    def wait_calls(self, method: str, path: str, count: int, timeout_s: float = 10.0) -> None:
        """Until ``count`` such requests were made (polled: no fixed sleeps)."""
        deadline = time.monotonic() + timeout_s
        while len(self.calls(method, path)) < count:
            assert time.monotonic() < deadline, (method, path, count, self.requests)
            self.page.wait_for_timeout(50)

    def send(self, text: str) -> None:
        self.page.fill("#input", "")
        self.page.type("#input", text, delay=15)
        self.page.keyboard.press("Enter")
        self.wait_idle()

    def wait_idle(self) -> None:
        self.page.wait_for_function(
            "() => !document.querySelector('#form').classList.contains('overture-busy')"
            " && document.querySelectorAll('.overture-assistant').length > 0")

    def answers(self) -> list[str]:
        return self.page.eval_on_selector_all(
            ".overture-assistant .overture-body", "els => els.map(e => e.innerText)")

    def statuses(self) -> list[str]:
        return self.page.eval_on_selector_all(
            ".overture-assistant", "els => els.map(e => (e.querySelector('.overture-status, "
            ".overture-error') || {}).innerText || '')")

    def history(self) -> list[dict[str, str]]:
        return self.page.evaluate(
            "() => window.overtureWidget.history.map(({role, content}) => ({role, content}))")

    def recompute(self, messages: list[dict[str, str]]) -> str:
        status, answer = self.cluster.post("/v1/chat/completions", {
            "model": "demo-tiny", "messages": messages, "temperature": 0, "max_tokens": 24})
        assert status == 200, answer
        return answer["choices"][0]["message"]["content"]


@pytest.fixture
def chat(browser: Any, cluster: Cluster) -> Iterator[Chat]:
    context = browser.new_context()
    page = context.new_page()
    page.goto(cluster.url + PAGE)
    page.wait_for_function("() => window.overtureWidget !== undefined")
    yield Chat(page, cluster)
    context.close()


def _text(s: str) -> str:
    return " ".join(s.split())


def test_typing_advises_once_and_the_answer_streams_in(chat: Chat) -> None:
    chat.page.type("#input", "Tell me about the sea, please.", delay=25)
    chat.wait_calls("POST", "/v1/advisory", 1)
    chat.page.wait_for_timeout(300)  # (and no second one comes)
    advised = chat.calls("POST", "/v1/advisory")
    assert len(advised) == 1, chat.requests
    sent = json.loads(advised[0][1])
    assert set(sent) == {"session_id", "model", "expected_arrival_s"}  # (no draft text)
    chat.page.keyboard.press("Enter")
    chat.wait_idle()
    (turn,) = chat.calls("POST", "/v1/chat/completions")
    assert advised[0][0] < turn[0] and json.loads(turn[1])["stream"] is True
    assert len(chat.calls("POST", "/v1/advisory")) == 1  # one advisory for the turn
    assert not chat.calls("DELETE", "/v1/advisory/")  # (followed: nothing to invalidate)
    (answer,) = chat.answers()
    assert _text(answer) == _text(chat.recompute(chat.history()[:-1]))
    assert "first token" in chat.statuses()[0] and "served by node0" in chat.statuses()[0]
    ARTIFACTS.mkdir(exist_ok=True)
    chat.page.screenshot(path=str(ARTIFACTS / "widget.png"), full_page=True)


def test_a_cleared_or_abandoned_draft_invalidates_its_advisory(chat: Chat) -> None:
    chat.page.type("#input", "a draft", delay=20)
    chat.wait_calls("POST", "/v1/advisory", 1)
    chat.page.wait_for_function("() => window.overtureWidget.advisoryId !== null")
    chat.page.fill("#input", "")
    chat.page.dispatch_event("#input", "input")
    chat.wait_calls("DELETE", "/v1/advisory/", 1)
    chat.page.type("#input", "another", delay=20)  # a new advisory, left alone 1.5 s
    chat.wait_calls("POST", "/v1/advisory", 2)
    chat.wait_calls("DELETE", "/v1/advisory/", 2)
    assert len(chat.calls("POST", "/v1/advisory")) == 2


def test_the_second_turn_reuses_the_session_and_a_reload_keeps_it(chat: Chat) -> None:
    chat.send("First, a question about mountains and rivers in the north.")
    chat.send("And a second one about the weather there.")
    statuses = chat.statuses()
    cached = int(statuses[1].split(" tokens cached")[0].split()[-1])
    assert cached > 0, statuses
    before = chat.answers()
    chat.page.reload()
    chat.page.wait_for_function("() => window.overtureWidget !== undefined")
    assert chat.answers() == before
    assert len(chat.history()) == 4


def test_server_errors_are_shown(chat: Chat) -> None:
    chat.page.evaluate("() => { window.overtureWidget.model = 'no-such-model'; }")
    chat.send("hello?")
    (status,) = chat.statuses()
    assert "Error:" in status and "does not exist" in status


def test_stop_cancels_the_stream(chat: Chat) -> None:
    chat.page.goto(chat.cluster.url + "/?temperature=0&max_tokens=3000")
    chat.page.wait_for_function("() => window.overtureWidget !== undefined")
    chat.page.fill("#input", "Write a very long story.")
    chat.page.keyboard.press("Enter")
    chat.page.wait_for_function(
        "() => (document.querySelector('.overture-assistant .overture-body') || {})"
        ".innerText?.length > 0")
    chat.page.click("#stop")
    chat.wait_idle()
    assert "stopped" in chat.statuses()[-1]
    deadline = time.monotonic() + 10  # the scheduler and the engine let the request go
    while "overture_requests_in_flight 0.0" not in chat.cluster.text("/metrics"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_edit_and_regenerate_give_what_recomputation_gives(chat: Chat) -> None:
    chat.send("What is the tallest mountain?")
    chat.send("How high is it?")
    chat.page.click(".overture-user >> nth=0 >> .overture-edit")
    chat.page.fill(".overture-edit-text", "What is the longest river?")
    chat.page.click(".overture-send-edit")
    chat.wait_idle()
    history = chat.history()
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[0]["content"] == "What is the longest river?"
    assert _text(chat.answers()[-1]) == _text(chat.recompute(history[:1]))
    first = chat.answers()[-1]
    chat.page.click(".overture-assistant >> nth=-1 >> .overture-regenerate")
    chat.wait_idle()
    assert chat.answers()[-1] == first  # (greedy: regenerating gives the same answer)


def test_model_output_never_becomes_html(chat: Chat) -> None:
    evil = ("Hi <img src=x onerror=\"window.pwned=1\"> and <script>window.pwned=2</script>"
            "\n\n```html\n<b>code</b>\n```\n- **bold** item\n- `inline` item")
    events = [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}]}
              for part in (evil[:20], evil[20:])]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    chat.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, body=body, headers={"Content-Type": "text/event-stream"}))
    chat.send("show me")
    out = chat.page.locator("#output")
    assert out.locator("img").count() == 0 and out.locator("script").count() == 0
    assert chat.page.evaluate("() => window.pwned") is None
    text = chat.answers()[0]
    assert "<img src=x onerror=" in text and "<script>" in text
    assert out.locator("pre code").inner_text() == "<b>code</b>"
    assert out.locator("li strong").inner_text() == "bold"
