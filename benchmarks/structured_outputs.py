"""Structured output end to end: 20 JSON Schemas of varied shape, each asked through the official openai
client's `chat.completions.parse(response_format=Model)` and through LangChain's
`ChatOpenAI.with_structured_output(Model, method="json_schema")`, against a real `fusion serve`
(the default trio unless --config says otherwise). Counts the answers that parse and validate, and
how many stopped at max_tokens before the object closed (cut, not malformed).

    pip install langchain-openai      # benchmark only
    python benchmarks/structured_outputs.py [--config F] [--max-tokens 160] [--json benchmarks/results/structured_outputs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import date
from enum import Enum
from typing import Literal, Optional

from pydantic import BaseModel, Field, ValidationError


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]


class Point(BaseModel):
    x: int
    y: int


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)


class Sum(BaseModel):
    a: int
    b: int
    total: int


class Answer(BaseModel):
    answer: int
    confident: bool


class Weekday(str, Enum):
    monday = "Monday"
    tuesday = "Tuesday"
    wednesday = "Wednesday"


class Meeting(BaseModel):
    day: Weekday
    hour: int = Field(ge=0, le=23)


class Tags(BaseModel):
    tags: list[str] = Field(max_length=4)


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)


class Customer(BaseModel):
    name: str = Field(max_length=30)
    address: Address


class Item(BaseModel):
    name: str = Field(max_length=20)
    price: float


class Order(BaseModel):
    items: list[Item] = Field(max_length=3)


class Flag(BaseModel):
    enabled: bool


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: Optional[str] = Field(default=None, max_length=60)


class Translation(BaseModel):
    source: str = Field(max_length=40)
    french: str = Field(max_length=40)


class Function(BaseModel):
    name: str = Field(max_length=30)
    arguments: list[str] = Field(max_length=3)
    returns: Literal["int", "str", "bool", "None"]


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=3)


class Planet(BaseModel):
    name: Literal["Mercury", "Venus", "Earth", "Mars"]
    moons: int = Field(ge=0, le=100)


class Book(BaseModel):
    title: str = Field(max_length=40)
    author: str = Field(max_length=30)
    year: int = Field(ge=1000, le=2100)


class Step(BaseModel):
    number: int
    action: str = Field(max_length=40)


class Recipe(BaseModel):
    dish: str = Field(max_length=30)
    steps: list[Step] = Field(max_length=3)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    score: float = Field(ge=0, le=1)


CASES: list[tuple[type[BaseModel], str]] = [
    (Colour, "Pick a primary colour."), (Point, "Give a point on the line y = 2x."),
    (Person, "Invent a person."), (Sum, "Add 47 and 38."), (Answer, "What is 12 * 3?"),
    (Meeting, "Schedule a meeting early in the week."), (Tags, "Tag this text: Python web servers are fast."),
    (Customer, "Invent a customer living in Paris."), (Order, "Order two fruits."), (Flag, "Should dark mode be on?"),
    (Rating, "Rate a good movie."), (Translation, "Translate 'good morning' to French."),
    (Function, "Describe a Python function that adds two numbers."), (Matrix, "Give the 2x2 identity matrix."),
    (Planet, "Which planet do we live on?"), (Book, "Name a famous novel."), (Step, "First step of making tea?"),
    (Recipe, "How do I make toast?"), (Sentiment, "Sentiment of: I love this!"),
    (Sum, "Add 5 and 9."),
]


def start_server(config: str | None, port: int, grpc_port: int = 0) -> subprocess.Popen:
    """`fusion serve` with its HTTP API on `port` (and gRPC on `grpc_port`), once it says it serves."""
    args = [sys.executable, "-m", "fusion.tools.cli", "serve", "--port", str(grpc_port), "--http-port", str(port),
            "--host", "127.0.0.1"] + (["--config", config] if config else [])
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    deadline = time.monotonic() + 600
    for line in proc.stderr:
        if "http" in line.lower() and "serving" in line.lower():
            # keep reading its log, so that a full pipe never blocks the server
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("fusion serve did not start")


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json")
    args = parser.parse_args()
    proc = start_server(args.config, args.port)
    base = f"http://127.0.0.1:{args.port}/v1"
    results: dict[str, dict] = {"openai_parse": {}, "langchain": {}}
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
        for i, (model, prompt) in enumerate(CASES):
            completion = client.chat.completions.parse(model="fusion", messages=[{"role": "user", "content": prompt}],
                                                       max_tokens=args.max_tokens, response_format=model)
            choice = completion.choices[0]
            ok = isinstance(choice.message.parsed, model)
            results["openai_parse"][f"{i}:{model.__name__}"] = {"ok": ok, "finish": choice.finish_reason,
                                                               "text": choice.message.content}
            print(f"parse     {model.__name__:12} {'ok' if ok else 'FAIL'} {choice.finish_reason:7} {choice.message.content}")
        try:
            from langchain_openai import ChatOpenAI
        except ImportError:
            results["langchain"] = "not installed (pip install langchain-openai)"
        else:
            chat = ChatOpenAI(model="fusion", base_url=base, api_key="none", max_tokens=args.max_tokens,
                              temperature=0, max_retries=0)
            for i, (model, prompt) in enumerate(CASES):
                try:
                    parsed = chat.with_structured_output(model, method="json_schema").invoke(prompt)
                    ok, detail = isinstance(parsed, model), parsed.model_dump_json() if parsed is not None else None
                except (ValidationError, ValueError, json.JSONDecodeError, openai.APIError) as err:
                    ok, detail = False, f"{type(err).__name__}: {str(err)[:160]}"
                results["langchain"][f"{i}:{model.__name__}"] = {"ok": ok, "detail": detail}
                print(f"langchain {model.__name__:12} {'ok' if ok else 'FAIL'} {detail}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    summary = {}
    for name, rows in results.items():
        if isinstance(rows, dict):
            summary[name] = {"schemas": len(rows), "valid": sum(r["ok"] for r in rows.values()),
                             "cut_by_max_tokens": sum(1 for r in rows.values() if r.get("finish") == "length")}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date.today().isoformat(), "max_tokens": args.max_tokens, "summary": summary,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
