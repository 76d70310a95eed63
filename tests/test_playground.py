"""The web playground (`services/playground/`, served at `/` and `/playground` by the HTTP API) in a
real browser: Debian's headless chromium, driven by Selenium, against a coordinator serving HTTP on
loopback over tiny experts on their own Expert servers (the fixtures of tests/test_http.py).

The page must show what the API returns for the same request: the tokens, the expert each one is
coloured by, the attribution behind it; stop (and leaving the page) must free every expert's
sessions; a wrong key must show the server's own message. Waits are explicit, on DOM conditions.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest

from fusion.services.http_api import PLAYGROUND_DIR
from fusion.services.api_keys import create_key
from tests.helpers import HANG_S, wait_until
from tests.test_grpc import addr, expert_sessions
from tests.test_http import experts, no_sessions_left, post, start  # noqa: F401 (a fixture)

CHROMIUM = os.environ.get("FUSION_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("FUSION_CHROMEDRIVER", "/usr/bin/chromedriver")
LIMITS = {"max_prompt_tokens": 256, "max_tokens": 400, "max_request_bytes": 64 * 1024}
PROMPT = "what is 12 + 35 ?"
WAIT_S = 120


@pytest.fixture(scope="module")
def coordinator(loop, tiny_dir, experts):  # noqa: F811
    server, _, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()}, limits=LIMITS)
    yield server, f"http://127.0.0.1:{http_port}"
    loop.run(server.stop(0))


@pytest.fixture(scope="module")
def browser():
    """Headless chromium. Missing is a failure, not a skip: `.ci/run` installs it."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the playground tests need selenium: pip install -e '.[dev]'")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(path)):
            pytest.fail(f"{path} is missing: apt-get install -y chromium chromium-driver (as .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(driver, condition, timeout: float = WAIT_S, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message)


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait_for(driver, lambda d: by_css(d, "#weights input") or not by_css(d, "#error")[0].get_attribute("hidden"),
             message="the page did not load the service description")


def set_value(driver, element_id: str, value) -> None:
    """A form field's value as a user would leave it (the page reads its fields when Run is pressed)."""
    driver.execute_script("const e = document.getElementById(arguments[0]);"
                          "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
                          element_id, value)


def panes_state(driver) -> dict[str, str]:
    return {p.get_attribute("data-pane"): p.get_attribute("data-state") for p in by_css(driver, ".pane")}


def pane_tokens(driver, pane: str) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll(`.pane[data-pane='${arguments[0]}'] .tok`)]"
        ".map(s => ({text: s.textContent, expert: s.dataset.expert}));", pane)


def api_answer(url: str, body: dict, headers: dict | None = None) -> dict:
    status, answer = post(url + "/v1/chat/completions", json.dumps({**body, "stream": False}).encode(), headers)
    assert status == 200, answer
    return answer["choices"][0]


def leader(attribution: list[dict]) -> str:
    """The expert that contributed most: the largest weight x own probability (the page's rule)."""
    best = max(attribution, key=lambda a: -1 if a["prob"] is None else a["weight"] * a["prob"])
    return best["expert"]


# -- the page and its endpoint ---------------------------------------------------------------------------
def test_page_and_describe_are_served(coordinator, tiny_config):
    server, url = coordinator
    for path in ("/", "/playground", "/playground/"):
        with urllib.request.urlopen(url + path, timeout=HANG_S) as reply:
            assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/html")
            assert "script-src 'self'" in reply.headers["Content-Security-Policy"]
            assert b"/playground/playground.js" in reply.read()
    for name in ("playground.js", "playground.css"):
        with urllib.request.urlopen(f"{url}/playground/{name}", timeout=HANG_S) as reply:
            assert reply.read() == (PLAYGROUND_DIR / name).read_bytes()
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{url}/playground/..%2Fhttp_server.py", timeout=HANG_S)
    assert missing.value.code == 404
    with urllib.request.urlopen(url + "/v1/fusion/describe", timeout=HANG_S) as reply:
        described = json.load(reply)
    assert [e["name"] for e in described["experts"]] == ["a", "b", "c"]
    assert [e["default_weight"] for e in described["experts"]] == [0.5, 0.3, 0.2]
    assert described["rules"]["single"] == ["expert"] and described["rules"]["confidence"] == ["tau", "combine"]
    assert described["profiles"] == {"ab": {"a": 1.0, "b": 1.0}, "only_a": {"a": 1.0}}
    assert described["default_spec"]["rule"] == "weighted_logits"
    assert described["default_sampling"]["temperature"] == 0.0
    assert described["limits"]["max_tokens"] == 400
    assert described["models"] == ["fusion", "fusion:ab", "fusion:only_a"]


# -- in the browser -------------------------------------------------------------------------------------
def test_page_loads_prefilled_from_the_service(coordinator, browser):
    _, url = coordinator
    open_page(browser, url + "/playground")
    assert by_css(browser, "#error")[0].get_attribute("hidden")
    assert "3 experts (a, b, c)" in by_css(browser, "#service")[0].text
    assert by_css(browser, "#rule")[0].get_attribute("value") == "weighted_logits"
    sliders = {s.get_attribute("data-expert"): float(s.get_attribute("value")) for s in by_css(browser, "#weights input")}
    assert sliders == {"a": 0.5, "b": 0.3, "c": 0.2}
    profiles = [o.get_attribute("value") for o in by_css(browser, "#profile option")]
    assert profiles == ["", "ab", "only_a"]
    assert by_css(browser, "#max_tokens")[0].get_attribute("max") == "400"


def test_tokens_colours_and_details_match_the_api(coordinator, browser):
    """A seeded sampled run: every pane's tokens, each token's colour and the hover details are the
    API's for the same request; the expert panes are each expert alone."""
    from selenium.webdriver.common.action_chains import ActionChains

    _, url = coordinator
    open_page(browser, url + "/")
    for field, value in {"prompt": PROMPT, "max_tokens": "12", "temperature": "0.9", "seed": "11",
                         "top_logprobs": "3"}.items():
        set_value(browser, field, value)
    by_css(browser, "#run")[0].click()
    wait_for(browser, lambda d: set(panes_state(d).values()) == {"done"} and len(panes_state(d)) == 4,
             message="the panes did not finish")
    assert list(panes_state(browser)) == ["fused", "expert:a", "expert:b", "expert:c"]

    body = {"model": "fusion", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "temperature": 0.9, "top_p": 1.0, "top_k": 0, "seed": 11, "logprobs": True, "top_logprobs": 3}
    fused = api_answer(url, {**body, "fusion": {"rule": "weighted_logits", "attribution": True}})
    attributions = [t["attribution"] for t in fused["fusion"]["tokens"]]
    shown = pane_tokens(browser, "fused")
    assert "".join(t["text"] for t in shown) == fused["message"]["content"]
    assert [t["expert"] for t in shown] == [leader(a) for a in attributions]
    assert len(shown) == len(attributions) > 0

    # The chart: the share of tokens each expert drove.
    counts = {r.get_attribute("data-expert"): int(r.get_attribute("data-count"))
              for r in by_css(browser, ".pane[data-pane='fused'] svg.share rect")}
    assert counts == {e: [leader(a) for a in attributions].count(e) for e in "abc"}

    # Hovering a token shows every expert's weight and own probability, the fused logprob, the alternatives.
    index = min(3, len(shown) - 1)
    span = by_css(browser, f".pane[data-pane='fused'] .tok[data-index='{index}']")[0]
    ActionChains(browser).move_to_element(span).perform()
    wait_for(browser, lambda d: not by_css(d, "#details")[0].get_attribute("hidden")
             and by_css(d, "#details")[0].get_attribute("data-index") == str(index), message="no details on hover")
    rows = {r.get_attribute("data-expert"): r for r in by_css(browser, "#details tr[data-expert]")}
    expected = {a["expert"]: a for a in attributions[index]}
    assert set(rows) == set(expected) == {"a", "b", "c"}
    for name, row in rows.items():
        assert float(row.get_attribute("data-weight")) == expected[name]["weight"]
        # the page ran four requests in one batch, the API one: float32 sums may differ in the last bits
        assert float(row.get_attribute("data-prob")) == pytest.approx(expected[name]["prob"], rel=1e-4, abs=1e-7)
        assert row.find_element("css selector", "td.col-weight").text == f"{expected[name]['weight']:.3f}"
    logprob = fused["logprobs"]["content"][index]
    assert float(by_css(browser, "#details .fused")[0].get_attribute("data-logprob")) == pytest.approx(
        logprob["logprob"], abs=1e-4)
    alternatives = [(r.get_attribute("data-token"), float(r.get_attribute("data-logprob")))
                    for r in by_css(browser, "#details table.top tr")]
    assert [t for t, _ in alternatives] == [t["token"] for t in logprob["top_logprobs"]]
    assert [lp for _, lp in alternatives] == pytest.approx([t["logprob"] for t in logprob["top_logprobs"]], abs=1e-4)
    assert len(alternatives) == 3

    # Side by side: each expert alone (rule single), the same prompt and seed.
    for name in "abc":
        alone = api_answer(url, {**body, "fusion": {"rule": "single", "params": {"expert": name}, "attribution": True}})
        tokens = pane_tokens(browser, f"expert:{name}")
        assert "".join(t["text"] for t in tokens) == alone["message"]["content"]
        assert {t["expert"] for t in tokens} == {name} and len(tokens) == len(alone["fusion"]["tokens"])


def test_weights_over_the_sequence(coordinator, browser):
    """A rule whose weights change per step (confidence here, the router's with `route`) gets a line
    per expert of its weights over the sequence, the weights the API reports for each token."""
    _, url = coordinator
    open_page(browser, url + "/")
    browser.execute_script("const r = document.getElementById('rule'); r.value = 'confidence';"
                           "r.dispatchEvent(new Event('change'));")
    wait_for(browser, lambda d: by_css(d, "#param-tau"))
    set_value(browser, "param-tau", "0.5")
    for field, value in {"prompt": PROMPT, "max_tokens": "8", "compare": False}.items():
        set_value(browser, field, value)
    by_css(browser, "#run")[0].click()
    wait_for(browser, lambda d: panes_state(d) == {"fused": "done"} and by_css(d, "svg.weights-chart polyline"),
             message="no weights chart")
    body = {"model": "fusion", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "fusion": {"rule": "confidence", "params": {"tau": 0.5},
                                                                      "attribution": True}}
    tokens = api_answer(url, body)["fusion"]["tokens"]
    for line in by_css(browser, "svg.weights-chart polyline"):
        expert = line.get_attribute("data-expert")
        heights = [1 - float(p.split(",")[1]) for p in line.get_attribute("points").split()]
        weights = [next(a["weight"] for a in t["attribution"] if a["expert"] == expert) for t in tokens]
        assert heights == pytest.approx(weights, abs=1e-4), expert
    assert {line.get_attribute("data-expert") for line in by_css(browser, "svg.weights-chart polyline")} == set("abc")


def test_stop_and_leaving_cancel_the_requests(coordinator, browser, experts):  # noqa: F811
    server, url = coordinator
    for leave in (False, True):
        open_page(browser, url + "/")
        set_value(browser, "max_tokens", "400")
        set_value(browser, "ignore_eos", True)
        by_css(browser, "#run")[0].click()
        # Tokens stream into the page while the request runs.
        wait_for(browser, lambda d: panes_state(d).get("fused") == "streaming"
                 and len(pane_tokens(d, "fused")) >= 3, message="no tokens streamed")
        assert all(expert_sessions(port) >= 1 for _, port in experts.values())
        if leave:
            browser.get("about:blank")
        else:
            by_css(browser, "#stop-button")[0].click()
            wait_for(browser, lambda d: set(panes_state(d).values()) == {"stopped"}, message="stop did not stop")
            assert by_css(browser, "#error")[0].get_attribute("hidden")
        assert no_sessions_left(server, experts)
        assert wait_until(lambda: json.load(urllib.request.urlopen(url + "/v1/fusion/describe", timeout=HANG_S))
                          ["active_requests"] == 0)


def test_keys_and_the_servers_messages(loop, tiny_dir, experts, browser, tmp_path):  # noqa: F811
    path = tmp_path / "keys.yaml"
    key = create_key(path, "play")
    server, _, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()},
                                 limits=LIMITS, security={"api_keys_file": str(path)})
    url = f"http://127.0.0.1:{http_port}"
    try:
        open_page(browser, url + "/")  # no key yet: the server's 401, readable
        _, missing = post(url + "/v1/chat/completions", b"{}")
        error = by_css(browser, "#error")[0]
        assert "HTTP 401" in error.text and missing["error"]["message"] in error.text

        wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")
        _, refused = post(url + "/v1/chat/completions", b"{}", {"Authorization": f"Bearer {wrong}"})
        by_css(browser, "#key")[0].send_keys(wrong)
        by_css(browser, "#connect")[0].click()
        wait_for(browser, lambda d: refused["error"]["message"] in by_css(d, "#error")[0].text
                 and "authentication_error" in by_css(d, "#error")[0].text, message="no message for a wrong key")

        key_field = by_css(browser, "#key")[0]
        key_field.clear()
        key_field.send_keys(key)
        by_css(browser, "#connect")[0].click()
        wait_for(browser, lambda d: by_css(d, "#weights input") and by_css(d, "#error")[0].get_attribute("hidden"))
        set_value(browser, "max_tokens", "4")
        set_value(browser, "compare", False)
        set_value(browser, "temperature", "-1")  # refused by the server: its message, in the pane and on top
        by_css(browser, "#run")[0].click()
        wait_for(browser, lambda d: panes_state(d) == {"fused": "error"}, message="no error for a bad field")
        assert "HTTP 400" in by_css(browser, "#error")[0].text and "temperature" in by_css(browser, "#error")[0].text
        set_value(browser, "temperature", "0")
        by_css(browser, "#run")[0].click()
        wait_for(browser, lambda d: panes_state(d) == {"fused": "done"}, message="the keyed run did not finish")
        assert len(pane_tokens(browser, "fused")) == 4
        # The key lives in the page's memory only.
        assert browser.execute_script("return localStorage.length + sessionStorage.length") == 0
        assert key not in browser.execute_script("return document.cookie")
    finally:
        loop.run(server.stop(0))


def test_keyboard_structured_mode_and_a_key_of_one_stream(loop, tiny_dir, experts, browser, tmp_path):  # noqa: F811
    """Ctrl+Enter runs; tokens are reached by Tab and pinned by Enter; plain mode hides the System field;
    a structured-output run gives a valid object in every pane; a key allowed one stream at a time still
    fills all four side-by-side panes (the refused ones run again one by one)."""
    from selenium.webdriver.common.keys import Keys

    path = tmp_path / "keys.yaml"
    key = create_key(path, "one", limits={"max_concurrent_streams": 1})
    server, _, http_port = start(loop, tiny_dir, {n: [addr(p)] for n, (_, p) in experts.items()},
                                 limits=LIMITS, security={"api_keys_file": str(path)})
    url = f"http://127.0.0.1:{http_port}"
    try:
        open_page(browser, url + "/")  # its first description request, keyless, is refused: wait for it
        by_css(browser, "#key")[0].send_keys(key, Keys.ENTER)
        wait_for(browser, lambda d: by_css(d, "#weights input") and by_css(d, "#error")[0].get_attribute("hidden"))
        set_value(browser, "mode", "plain")
        browser.execute_script("document.getElementById('mode').dispatchEvent(new Event('change'))")
        assert not by_css(browser, "#system")[0].is_displayed()
        set_value(browser, "mode", "chat")
        browser.execute_script("document.getElementById('mode').dispatchEvent(new Event('change'))")
        assert by_css(browser, "#system")[0].is_displayed()

        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        set_value(browser, "structured-kind", "json")
        browser.execute_script("document.getElementById('structured-kind').dispatchEvent(new Event('change'))")
        set_value(browser, "structured", json.dumps(schema))
        set_value(browser, "max_tokens", "24")
        by_css(browser, "#prompt")[0].send_keys(Keys.CONTROL, Keys.ENTER)
        wait_for(browser, lambda d: len(panes_state(d)) == 4 and set(panes_state(d).values()) == {"done"},
                 message="the side-by-side panes did not all finish with a one-stream key")
        for pane in ("fused", "expert:a", "expert:b", "expert:c"):
            text = "".join(t["text"] for t in pane_tokens(browser, pane))
            assert isinstance(json.loads(text)["ok"], bool), (pane, text)

        first = by_css(browser, ".pane[data-pane='fused'] .tok")[0]
        browser.execute_script("arguments[0].focus()", first)
        wait_for(browser, lambda d: not by_css(d, "#details")[0].get_attribute("hidden"), message="focus shows no details")
        first.send_keys(Keys.ENTER)
        assert "selected" in first.get_attribute("class")
    finally:
        loop.run(server.stop(0))
