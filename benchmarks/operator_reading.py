"""Who reads the operation out of a wording it was never trained on?

The arithmetic specialist's answer starts by restating the question ("56-12: ..."). Given the chat
prompt and the right first operand, this measures how often each expert puts the right operator
(`+`, `-`, `*`) above the other two at that position, and how often their two log-probabilities summed
do, for the same held-out problems in every phrasing set of `fusion.tools.training.arithmetic`
("train": in-template; "held_out", "fresh", "novel": out-of-template). Out of template, the trio can be
no better than what its experts read here: routing picks among their beliefs, it adds no reading of
its own. Also: how often each puts the first operand's first digit above the second's on the first
answer token (where the two differ). And a linear probe for the operation on SmolLM2's hidden states
(`--probe-layers`): how much a specialist reading its first layers, instead of its input embeddings,
could read out of unseen wordings.

    python benchmarks/operator_reading.py --cache-dir ~/.cache/fusion --problems 90
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusion.compute import run_on_compute_thread
from fusion.models import default_cache_dir, model_dir
from fusion.tools.training.arithmetic import (PHRASINGS, Problem, chat_prompt, held_out_problems, make_questions,
                                              question_text, training_question)

logger = logging.getLogger("operator_reading")
EXPERTS = ("smollm2-135m-instruct", "arith-specialist")
OPERATORS = ("+", "-", "*")  # one SmolLM2 token each


@torch.no_grad()
def read_set(models: dict, tokenizer, phrasing: str, problems: int, seed: int) -> dict:
    operator_ids = [tokenizer.convert_tokens_to_ids(op) for op in OPERATORS]
    right = {name: 0 for name in (*models, "sum")}
    first = {name: 0 for name in models}
    compared = 0  # problems whose operands start with different digits
    for (question, _), problem in zip(make_questions(problems, seed, phrasing), held_out_problems(problems, seed)):
        asked = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
        # As decoding sees it: the prompt's ids, then the first operand's ids as the answer begins.
        restated = torch.tensor([asked + tokenizer(str(problem.a), add_special_tokens=False)["input_ids"]])
        want = OPERATORS.index(problem.op)
        digits = [tokenizer.convert_tokens_to_ids(str(n)[0]) for n in (problem.a, problem.b)]
        compared += digits[0] != digits[1]
        total = torch.zeros(len(OPERATORS))
        for name, model in models.items():
            logits = model(restated).logits[0].float()  # (S, V)
            at_operator = logits[-1].log_softmax(-1)[operator_ids]  # (3,)
            total += at_operator
            right[name] += int(at_operator.argmax()) == want
            at_start = logits[len(asked) - 1]  # (V,): the answer's first id
            first[name] += digits[0] != digits[1] and bool(at_start[digits[0]] > at_start[digits[1]])
        right["sum"] += int(total.argmax()) == want
    return {"operator": {k: v / problems for k, v in right.items()},
            "first_operand": {k: v / max(compared, 1) for k, v in first.items()}}


@torch.no_grad()
def probe_layers(model, tokenizer, layers: list[int], train: int, test: int, seed: int) -> dict:
    """A linear probe for the operation on SmolLM2's states (mean over the question's tokens) at each of
    `layers` (0: the input embeddings), fitted on training wordings, read out on each other set."""
    def states(phrasing: str, n: int, offset: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        rng = random.Random(f"probe:{phrasing}:{seed + offset}")
        rows: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        ops = []
        for i in range(n):
            problem = Problem(op=OPERATORS[i % 3], a=rng.randint(10, 99), b=rng.randint(10, 99))
            question = (training_question(problem, rng) if phrasing == "train"
                        else question_text(problem, rng, phrasing))
            hidden = model(tokenizer(question, return_tensors="pt").input_ids, output_hidden_states=True).hidden_states
            for layer in layers:
                rows[layer].append(hidden[layer][0].mean(0))
            ops.append(i % 3)
        return {layer: torch.stack(r) for layer, r in rows.items()}, torch.tensor(ops)

    fit_x, fit_y = states("train", train, 0)
    sets = {phrasing: states(phrasing, test, 1) for phrasing in PHRASINGS}
    figures: dict[str, dict[str, float]] = {}
    for layer in layers:
        mean, std = fit_x[layer].mean(0), fit_x[layer].std(0) + 1e-6
        weight = torch.zeros(fit_x[layer].shape[1], 3, requires_grad=True)
        bias = torch.zeros(3, requires_grad=True)
        optimizer = torch.optim.LBFGS([weight, bias], max_iter=200)

        def loss() -> torch.Tensor:
            optimizer.zero_grad()
            with torch.enable_grad():
                value = F.cross_entropy((fit_x[layer] - mean) / std @ weight + bias, fit_y) + 1e-2 * weight.pow(2).sum()
                value.backward()
            return value

        optimizer.step(loss)
        figures[str(layer)] = {phrasing: float((((x[layer] - mean) / std @ weight + bias).argmax(1) == y).float().mean())
                               for phrasing, (x, y) in sets.items()}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: fusion's)")
    parser.add_argument("--problems", type=int, default=90, help="held-out problems per phrasing set")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--probe-layers", default="0,4", help="SmolLM2 layers to probe for the operation ('': none)")
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
        layers = [int(x) for x in args.probe_layers.split(",") if x.strip()]
        if layers:
            logger.info("probing SmolLM2's layers %s", layers)
            figures["probe"] = probe_layers(models[EXPERTS[0]], tokenizer, layers, 600, 150, args.seed)
        return figures

    figures = run_on_compute_thread(run)
    print(f"{'set':10s} {'operator: ' + ' / '.join((*EXPERTS, 'sum')):60s} first operand")
    for phrasing, f in figures.items():
        if phrasing == "probe":
            continue
        ops = " / ".join(f"{100 * v:.0f}%" for v in f["operator"].values())
        firsts = " / ".join(f"{100 * v:.0f}%" for v in f["first_operand"].values())
        print(f"{phrasing:10s} {ops:60s} {firsts}")
    for layer, by_set in figures.get("probe", {}).items():
        print(f"probe, layer {layer}: " + "  ".join(f"{k} {100 * v:.0f}%" for k, v in by_set.items()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
