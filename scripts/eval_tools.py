#!/usr/bin/env python
"""How well a bundle's model calls tools, on a small fixed prompt set, through a real server and the openai client.

12 prompts: 9 that need one of three tools (weather, arithmetic, unit conversion), 3 that need none. Each is
asked greedy with tool_choice "auto" and, for the 9, with "required". Counts: a call made when one was
needed (auto) / not made when none was (auto), the right function, the right arguments (exact values).
Every call parses and follows its schema by construction (the grammar); this measures whether the model
picks well. Prints a table and JSON.

  .venv/bin/python scripts/eval_tools.py /tmp/soak/smol.bundle [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                     "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "km_to_miles", "description": "Convert kilometres to miles.",
                                      "parameters": {"type": "object", "properties": {"km": {"type": "number"}},
                                                     "required": ["km"]}}},
]
CASES = [
    ("What's the weather in Paris?", "get_weather", {"city": "Paris"}),
    ("Is it raining in Tokyo right now?", "get_weather", {"city": "Tokyo"}),
    ("Tell me the current weather for London.", "get_weather", {"city": "London"}),
    ("What is 12 plus 30?", "add", {"a": 12, "b": 30}),
    ("Add 7 and 5.", "add", {"a": 7, "b": 5}),
    ("What is the sum of 100 and 23?", "add", {"a": 100, "b": 23}),
    ("How many miles is 10 km?", "km_to_miles", {"km": 10}),
    ("Convert 42 kilometres to miles.", "km_to_miles", {"km": 42}),
    ("A marathon is 42.195 km. How far is that in miles?", "km_to_miles", {"km": 42.195}),
    ("Hello! How are you?", None, None),
    ("Write a haiku about autumn.", None, None),
    ("Who wrote Romeo and Juliet?", None, None),
]


def _ask(client, prompt: str, choice: str):
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                       tool_choice=choice, temperature=0, max_tokens=80)
    calls = r.choices[0].message.tool_calls or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls], r.choices[0].message.content


def _same(got: dict, want: dict) -> bool:
    norm = {k: (v.strip().lower() if isinstance(v, str) else float(v)) for k, v in got.items()}
    return norm == {k: (v.lower() if isinstance(v, str) else float(v)) for k, v in want.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import openai

    from conftest import ServerProcess

    server = ServerProcess(args.bundle, "--no-ui", "--max-users", "2")
    rows = []
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        for prompt, fn, want in CASES:
            row = {"prompt": prompt, "expect": fn}
            calls, text = _ask(client, prompt, "auto")
            row["auto"] = {"calls": calls, "text": text}
            row["auto_ok"] = (bool(calls) == (fn is not None)) and (fn is None or calls[0][0] == fn)
            if fn is not None:
                calls, _ = _ask(client, prompt, "required")
                row["required"] = {"calls": calls}
                row["required_name_ok"] = calls[0][0] == fn
                row["required_args_ok"] = calls[0][0] == fn and _same(calls[0][1], want)
            rows.append(row)
    finally:
        server.stop()
    need = [r for r in rows if r["expect"]]
    none = [r for r in rows if not r["expect"]]
    summary = {
        "auto: called the right tool when one was needed": f"{sum(r['auto_ok'] for r in need)}/{len(need)}",
        "auto: answered in text when none was needed": f"{sum(r['auto_ok'] for r in none)}/{len(none)}",
        "required: right function": f"{sum(r['required_name_ok'] for r in need)}/{len(need)}",
        "required: right function and arguments": f"{sum(r['required_args_ok'] for r in need)}/{len(need)}",
    }
    for k, v in summary.items():
        print(f"{v:>6}  {k}")
    out = {"bundle": str(args.bundle), "summary": summary, "cases": rows}
    print(json.dumps(out, default=str)[:4000])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
