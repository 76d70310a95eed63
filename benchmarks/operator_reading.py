"""Who reads the operation out of a wording it was never trained on?

The arithmetic specialist's answer starts by restating the question ("56-12: ..."). Given the chat
prompt and the right first operand, this measures how often each expert puts the right operator
(`+`, `-`, `*`) above the other two at that position, and how often their two log-probabilities summed
do, for the same held-out problems in every phrasing set of `fusion.tools.training.arithmetic`
("train": in-template; "held_out", "fresh", "novel": out-of-template). Out of template, the trio can be
no better than what its experts read here: routing picks among their beliefs, it adds no reading of
its own. Also: how often each puts the first operand's first digit above the second's on the first
answer token (where the two differ).

    python benchmarks/operator_reading.py --cache-dir ~/.cache/fusion --problems 90
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusion.compute import run_on_compute_thread
from fusion.models import default_cache_dir, model_dir
from fusion.tools.training.arithmetic import PHRASINGS, chat_prompt, held_out_problems, make_questions

logger = logging.getLogger("operator_reading")
EXPERTS = ("smollm2-135m-instruct", "arith-specialist")
OPERATORS = ("+", "-", "*")  # one SmolLM2 token each


@torch.no_grad()
def read_set(models: dict, tokenizer, phrasing: str, problems: int, seed: int) -> dict:
    operator_ids = [tokenizer.convert_tokens_to_ids(op) for op in OPERATORS]
    right = {name: 0 for name in (*models, "sum")}
    first = {name: 0 for name in models}
    for (question, _), problem in zip(make_questions(problems, seed, phrasing), held_out_problems(problems, seed)):
        prompt = chat_prompt(tokenizer, question)
        restated = tokenizer(prompt + str(problem.a), add_special_tokens=False, return_tensors="pt").input_ids
        asked = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        want = OPERATORS.index(problem.op)
        digits = [tokenizer.convert_tokens_to_ids(str(n)[0]) for n in (problem.a, problem.b)]
        total = torch.zeros(len(OPERATORS))
        for name, model in models.items():
            at_operator = model(restated).logits[0, -1].float().log_softmax(-1)[operator_ids]  # (3,)
            total += at_operator
            right[name] += int(at_operator.argmax()) == want
            at_start = model(asked).logits[0, -1].float()  # (V,)
            first[name] += digits[0] == digits[1] or bool(at_start[digits[0]] > at_start[digits[1]])
        right["sum"] += int(total.argmax()) == want
    return {"operator": {k: v / problems for k, v in right.items()},
            "first_operand": {k: v / problems for k, v in first.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: fusion's)")
    parser.add_argument("--problems", type=int, default=90, help="held-out problems per phrasing set")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache = args.cache_dir or default_cache_dir()
    paths = {name: model_dir(cache, name) for name in EXPERTS}
    tokenizer = AutoTokenizer.from_pretrained(paths[EXPERTS[0]])

    def run() -> dict:
        models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                  for name, path in paths.items()}
        figures = {}
        for phrasing in PHRASINGS:
            logger.info("phrasing set %s: %d problems", phrasing, args.problems)
            figures[phrasing] = read_set(models, tokenizer, phrasing, args.problems, args.seed)
        return figures

    figures = run_on_compute_thread(run)
    print(f"{'set':10s} {'operator: ' + ' / '.join((*EXPERTS, 'sum')):60s} first operand")
    for phrasing, f in figures.items():
        ops = " / ".join(f"{100 * v:.0f}%" for v in f["operator"].values())
        firsts = " / ".join(f"{100 * v:.0f}%" for v in f["first_operand"].values())
        print(f"{phrasing:10s} {ops:60s} {firsts}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
