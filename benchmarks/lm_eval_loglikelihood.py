"""lm-evaluation-harness against `fusion serve`: its `local-completions` model runs a small local
multiple-choice task (log-likelihood requests: token-id prompts, `echo`, `logprobs`) over the OpenAI
completions API, and every per-choice log-likelihood it records is compared with what the same
server's Score RPC (what `fusion score --server` calls) gives for the same context and continuation.

    pip install lm-eval        # benchmark only
    python benchmarks/lm_eval_loglikelihood.py [--config F] [--json benchmarks/results/lm_eval_loglikelihood.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from structured_outputs import start_server  # this folder is on sys.path when run as a script

ITEMS = [
    {"question": "What is 47 + 38?", "choices": ["85", "75", "95"], "gold": 0},
    {"question": "What is 12 * 3?", "choices": ["36", "32", "312"], "gold": 0},
    {"question": "What is 90 - 45?", "choices": ["55", "45", "35"], "gold": 1},
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "gold": 0},
    {"question": "Water freezes at", "choices": ["0 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius"],
     "gold": 0},
    {"question": "In Python, the keyword to define a function is", "choices": ["def", "func", "lambda x"], "gold": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "gold": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "gold": 0},
]
TASK = """task: fusion_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
"""


def main() -> None:
    from fusion.models import SMOLLM2_NAME, default_cache_dir, model_dir
    from fusion.services.client import FusionClient

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--tokenizer", default=str(model_dir(default_cache_dir(), SMOLLM2_NAME)))
    parser.add_argument("--http-port", type=int, default=18081)
    parser.add_argument("--grpc-port", type=int, default=15051)
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    (work / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "fusion_local_choice.yaml").write_text(TASK.format(items=work / "items.jsonl"))
    proc = start_server(args.config, args.http_port, grpc_port=args.grpc_port)
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                   f"model=fusion,base_url=http://127.0.0.1:{args.http_port}/v1/completions,"
                   f"tokenizer_backend=huggingface,tokenizer={args.tokenizer},num_concurrent=1,max_retries=1",
                   "--tasks", "fusion_local_choice", "--include_path", str(tasks), "--log_samples",
                   "--output_path", str(work / "out")]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            sys.exit(f"lm_eval failed:\n{run.stderr[-3000:]}")
        samples = [json.loads(line) for path in (work / "out").rglob("samples_*.jsonl")
                   for line in path.read_text().splitlines()]
        rows = []
        with FusionClient(f"127.0.0.1:{args.grpc_port}", timeout=600) as client:
            for sample in samples:
                arguments = sample["arguments"]
                if isinstance(arguments, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
                    arguments = [(a["arg_0"], a["arg_1"]) for a in arguments.values()]
                for (context, continuation), response in zip(arguments, sample["resps"]):
                    harness = float(response[0][0])
                    scored = client.score(context, continuation).total_logprob
                    rows.append({"context": context, "continuation": continuation, "lm_eval": harness,
                                 "fusion_score": scored, "diff": abs(harness - scored)})
                    print(f"{context[:40]!r:44} {continuation!r:24} lm-eval {harness:9.4f}  score {scored:9.4f}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    worst = max(r["diff"] for r in rows)
    summary = {"items": len(samples), "requests": len(rows), "max_abs_diff": worst}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
