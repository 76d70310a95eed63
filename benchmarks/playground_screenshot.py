"""docs/playground.png: the web playground in headless chromium.

With `--default-trio CACHE`: the default config (SmolLM2 + the arithmetic and code specialists, the
`router: auto` router, all shipped but SmolLM2) from a model cache that `fusion models fetch --cache-dir CACHE` prepared.
Without it: the test suite's tiny random experts (a, b, c; tests/tiny_models.py) and a router trained
on them for a few seconds, so the text is noise and the picture shows only the page.

    python benchmarks/playground_screenshot.py [--default-trio CACHE] [--out docs/playground.png]

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
    parser.add_argument("--default-trio", type=Path, help="A model cache holding the default trio and its router.")
    parser.add_argument("--prompt", default="What is 12 + 35? Answer briefly.")
    args = parser.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from fusion.config import parse_config
    from fusion.frontdoor.service import FusionService
    from fusion.tools.router_training import RouterTrainSettings, train_router
    from fusion.services.background import BackgroundLoop
    from fusion.services.coordinator import create_coordinator_server
    from tests.conftest import tiny_config_dict
    from tests.tiny_models import CORPUS, make_model, make_tokenizer

    from fusion.config import load_config
    from fusion.models import model_resolver
    from fusion.tools.loading import DEFAULT_CONFIG

    if args.default_trio is not None:
        config, resolve, cache = load_config(DEFAULT_CONFIG), model_resolver(args.default_trio), args.default_trio
        settings = {"temperature": "0", "max_tokens": "64", "seed": "7", "ignore_eos": False}
    else:
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
        resolve, cache = (lambda ref: ref), None
        settings = {"temperature": "0.7", "max_tokens": "48", "seed": "7", "ignore_eos": True}

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100",
                "--hide-scrollbars"):
        options.add_argument(arg)
    with BackgroundLoop() as loop:
        server, _ = loop.run(create_coordinator_server(config, resolve, cache_dir=cache, http_address="127.0.0.1:0"))
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            wait = WebDriverWait(driver, 120, poll_frequency=0.05)
            driver.get(f"http://127.0.0.1:{server.http_port}/playground")
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#weights input"))
            for field, value in {"prompt": args.prompt, **settings}.items():
                driver.execute_script("const e = document.getElementById(arguments[0]);"
                                      "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
                                      field, value)
            driver.find_element(By.ID, "run").click()
            wait.until(lambda d: {p.get_attribute("data-state") for p in d.find_elements(By.CSS_SELECTOR, ".pane")}
                       == {"done"})
            driver.execute_script("window.scrollTo(0, 0)")
            tokens = driver.find_elements(By.CSS_SELECTOR, ".pane[data-pane='fused'] .tok")
            token = tokens[min(9, len(tokens) - 1)]
            ActionChains(driver).move_to_element(token).perform()
            wait.until(lambda d: not d.find_element(By.ID, "details").get_attribute("hidden"))
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            driver.quit()
            loop.run(server.stop(0))


if __name__ == "__main__":
    main()
