"""docs/playground.png: the web playground in headless chromium, over the test suite's tiny random
experts (a, b, c; tests/tiny_models.py) and a router trained on them for a few seconds, so the text is
noise: what the picture shows is the page (colours, attribution on hover, the side-by-side panes,
the charts), not an answer.

    python benchmarks/playground_screenshot.py [--out docs/playground.png]

Needs Debian's chromium and chromium-driver, and selenium (the `dev` extra).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "playground.png"))
    args = parser.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from fusion.config import parse_config
    from fusion.service import FusionService
    from fusion.tools.router_training import RouterTrainSettings, train_router
    from services.background import BackgroundLoop
    from services.coordinator import create_coordinator_server
    from tests.conftest import tiny_config_dict
    from tests.tiny_models import CORPUS, make_model, make_tokenizer

    root = Path(tempfile.mkdtemp(prefix="playground-"))
    tok = make_tokenizer(root / "tok")
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        make_model(root / name, tok, seed=seed)
    service = FusionService.from_config(parse_config(tiny_config_dict(root)))
    router = root / "router.pt"
    train_router(service, router, texts=itertools.cycle(CORPUS),
                 settings=RouterTrainSettings(minutes=1, max_texts=20, steps_per_text=3, lr=1e-2))
    service.close()
    config = parse_config(tiny_config_dict(root, routers={"tiny": str(router)},
                                           fusion={"rule": "route", "params": {"router": "tiny"}}))

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100",
                "--hide-scrollbars"):
        options.add_argument(arg)
    with BackgroundLoop() as loop:
        server, _ = loop.run(create_coordinator_server(config, http_address="127.0.0.1:0"))
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            wait = WebDriverWait(driver, 120, poll_frequency=0.05)
            driver.get(f"http://127.0.0.1:{server.http_port}/playground")
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#weights input"))
            for field, value in {"prompt": "What is 12 + 35? Answer briefly.", "max_tokens": "48", "seed": "7",
                                 "temperature": "0.7", "ignore_eos": True}.items():
                driver.execute_script("const e = document.getElementById(arguments[0]);"
                                      "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
                                      field, value)
            driver.find_element(By.ID, "run").click()
            wait.until(lambda d: {p.get_attribute("data-state") for p in d.find_elements(By.CSS_SELECTOR, ".pane")}
                       == {"done"})
            driver.execute_script("window.scrollTo(0, 0)")
            token = driver.find_element(By.CSS_SELECTOR, ".pane[data-pane='fused'] .tok[data-index='9']")
            ActionChains(driver).move_to_element(token).perform()
            wait.until(lambda d: not d.find_element(By.ID, "details").get_attribute("hidden"))
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            driver.quit()
            loop.run(server.stop(0))


if __name__ == "__main__":
    main()
