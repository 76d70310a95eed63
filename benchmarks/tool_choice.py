"""How often the fused distribution decides right under `tool_choice: "auto"`: 40 chat requests against
a real `fusion serve` (the default trio unless --config says otherwise) with one tool set of four
functions; 20 requests need one of them (the right function is known), 20 need none (greetings, facts,
writing, sums a model can do). Counts, per kind: the right decision (a call or none), the right
function, and arguments that validate against its schema. Greedy (the config's default).

    python benchmarks/tool_choice.py [--config F] [--max-tokens 96] [--json benchmarks/results/tool_choice.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_outputs import start_server  # noqa: E402


def function(name: str, description: str, **properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False}}}


TOOLS = [
    function("get_weather", "The current weather in a city.", city={"type": "string", "maxLength": 40}),
    function("convert_currency", "Convert an amount of money from one currency to another.",
             amount={"type": "number"}, source={"type": "string", "maxLength": 3},
             target={"type": "string", "maxLength": 3}),
    function("get_time", "The current local time in a time zone.", timezone={"type": "string", "maxLength": 40}),
    function("search_web", "Search the web for recent news or facts that change over time.",
             query={"type": "string", "maxLength": 80}),
]

NEEDS_A_CALL = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in London today?", "get_weather"),
    ("Tell me the current temperature in Tokyo.", "get_weather"),
    ("Should I take an umbrella in Berlin today? Check the weather.", "get_weather"),
    ("How cold is it in Oslo at the moment?", "get_weather"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 euros today?", "convert_currency"),
    ("I have 20 GBP; what is that in USD right now?", "convert_currency"),
    ("Exchange 1000 CHF into EUR at today's rate.", "convert_currency"),
    ("What's 75 Canadian dollars in US dollars today?", "convert_currency"),
    ("What time is it now in New York?", "get_time"),
    ("Tell me the current time in Europe/Madrid.", "get_time"),
    ("Is it morning or evening right now in Sydney? Check the clock.", "get_time"),
    ("What is the local time in Asia/Kolkata at the moment?", "get_time"),
    ("Get me the current time in UTC.", "get_time"),
    ("Search the web for today's top technology news.", "search_web"),
    ("Who won yesterday's football match between Arsenal and Chelsea?", "search_web"),
    ("Find the latest release notes of Python online.", "search_web"),
    ("Look up the current price of Bitcoin on the web.", "search_web"),
    ("What are this week's headlines about climate policy? Search for them.", "search_web"),
]

NEEDS_NO_CALL = [
    "Hello! How are you?",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "What is 2 + 2?",
    "Explain what a Python list is in one sentence.",
    "Thank you, that's all.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "How many days are in a week?",
    "What is the boiling point of water at sea level in Celsius?",
    "Summarize in one sentence: the cat sat on the mat all day.",
    "Is a tomato a fruit or a vegetable?",
    "Spell the word 'necessary' backwards.",
    "What colour do you get by mixing blue and yellow?",
    "Name three primary colours.",
    "Write a short greeting for a birthday card.",
    "What does CPU stand for?",
    "How many legs does a spider have?",
    "Tell me a fun fact about octopuses.",
]


def main() -> None:
    import jsonschema
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--port", type=int, default=18081)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    proc = start_server(args.config, args.port)
    rows = []
    started = time.monotonic()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        cases = [(prompt, name) for prompt, name in NEEDS_A_CALL] + [(prompt, None) for prompt in NEEDS_NO_CALL]
        for prompt, expected in cases:
            choice = client.chat.completions.create(
                model="fusion", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                max_tokens=args.max_tokens).choices[0]
            calls = choice.message.tool_calls or []
            valid = True
            for call in calls:
                try:
                    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                except (ValueError, jsonschema.ValidationError, KeyError):
                    valid = False
            row = {"prompt": prompt, "expected": expected, "finish": choice.finish_reason,
                   "called": [c.function.name for c in calls], "arguments": [c.function.arguments for c in calls],
                   "content": choice.message.content, "decided_right": bool(calls) == (expected is not None),
                   "right_function": expected is not None and [c.function.name for c in calls][:1] == [expected],
                   "arguments_valid": bool(calls) and valid}
            rows.append(row)
            print(f"{'call' if expected else 'none':4} {'ok ' if row['decided_right'] else 'BAD'} "
                  f"{row['called'] or '-'} {row['arguments'] or (choice.message.content or '')[:60]!r}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    needed = [r for r in rows if r["expected"]]
    not_needed = [r for r in rows if not r["expected"]]
    summary = {
        "needs_a_call": {"requests": len(needed), "called": sum(r["decided_right"] for r in needed),
                         "right_function": sum(r["right_function"] for r in needed),
                         "arguments_valid": sum(r["arguments_valid"] for r in needed)},
        "needs_no_call": {"requests": len(not_needed), "answered_in_text": sum(r["decided_right"] for r in not_needed)},
        "decided_right": sum(r["decided_right"] for r in rows), "requests": len(rows),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "config": args.config or "default trio",
                       "max_tokens": args.max_tokens, "summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
