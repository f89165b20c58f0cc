"""Model output -> OpenAI deltas, one streaming state machine per family (K2: `<think>` and
`<|tool_call*|>` markers; K3: XTML channels)."""

from k3serve.chat.parsers.base import StreamParser
from k3serve.chat.parsers.checks import is_degenerate, tool_call_error
from k3serve.chat.parsers.deltas import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    collect,
)
from k3serve.chat.parsers.k2 import K2Parser
from k3serve.chat.parsers.k3 import K3Parser
from k3serve.chat.parsers.tool_ids import mint_tool_call_id

__all__ = [
    "ContentDelta", "Delta", "K2Parser", "K3Parser", "ParsedMessage", "ReasoningDelta", "StreamParser",
    "ToolCall", "ToolCallArgs", "ToolCallStart", "collect", "is_degenerate", "mint_tool_call_id",
    "tool_call_error",
]
