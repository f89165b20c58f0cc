"""Chat formats for Kimi models: OpenAI messages -> tokenizer segments (renderers) and model
output -> OpenAI deltas (parsers). Pure Python: no HTTP, no engine."""

from k3serve.server.chat.formats import K2_INSTRUCT, K2_THINKING, K3, K25, STOP_TOKEN_ID, ChatFormat, chat_format_for
from k3serve.server.chat.request import ChatOptions
from k3serve.server.chat.segments import ImageSegment, Prompt, Segment, TextSegment

__all__ = [
    "K2_INSTRUCT", "K2_THINKING", "K25", "K3", "STOP_TOKEN_ID", "ChatFormat", "ChatOptions", "ImageSegment",
    "Prompt", "Segment", "TextSegment", "chat_format_for",
]
