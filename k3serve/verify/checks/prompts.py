"""The fixed requests the checks send. The tool call, decline and JSON requests are shapes a small K3 model
trained on the contract's formats answers well (README's example); the Chinese question and its json_schema
variant are Kimi Vendor Verifier's prompt-token anchors (36 and 119 under the kimi contract,
chat_format_examples.md §7.0)."""

from __future__ import annotations

from typing import Any

HOTEL = {"type": "function", "function": {
    "name": "book_hotel", "description": "Use this to book the hotel.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                   "required": ["city", "nights"]}}}
CAR = {"type": "function", "function": {
    "name": "rent_car", "description": "Use this to rent the car.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

TOOL_ASK = [{"role": "user", "content": 'Can you book the hotel?\ncity: "Paris"\nnights: 3'}]
DECLINE_ASK = [{"role": "user", "content": 'Can you fetch the lamp?\nsource: "samples"\nlimit: 4712'}]
JSON_ASK = [{"role": "user", "content": 'Return JSON for this user.\nname: 3578\ngenre: "Chicago"'}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "start_user", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "integer"}, "genre": {"type": "string"}},
    "required": ["name", "genre"], "additionalProperties": False}}}

KVV_ASK = [{"role": "user", "content": "请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。"}]
KVV_FORMAT = {"type": "json_schema", "json_schema": {"name": "capital_answer", "schema": {
    "type": "object", "properties": {"capital": {"type": "boolean"}}, "required": ["capital"],
    "additionalProperties": False}}}
KVV_TOKENS = {"plain": 36, "json_schema": 119}

TOOL_TURNS = [
    *TOOL_ASK,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.book_hotel:0", "type": "function",
                                                           "function": {"name": "book_hotel",
                                                                        "arguments": '{"city": "Paris", "nights": 3}'}}]},
    {"role": "tool", "tool_call_id": "functions.book_hotel:0", "content": '{"booking": "B-77", "status": "ok"}'},
    {"role": "user", "content": "What is the booking?"},
]

THINK_OFF = {"chat_template_kwargs": {"thinking": False}}


def thinking(on: bool) -> dict[str, Any]:
    """The per-request thinking switch both Moonshot's API and open-source engines read."""
    return {} if on else dict(THINK_OFF)
