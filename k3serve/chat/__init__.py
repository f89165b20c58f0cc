"""Chat formats for Kimi models: OpenAI messages -> tokenizer segments (renderers) and model
output -> OpenAI deltas (parsers). Pure Python: no HTTP, no engine. One tier above the tokenizer and below
everything that speaks the format (server, trainer, verifiers); it imports nothing of k3serve's but itself."""

from k3serve.chat.formats import K2_INSTRUCT, K2_THINKING, K3, K25, STOP_TOKEN_ID, ChatFormat, chat_format_for
from k3serve.chat.request import ChatOptions
from k3serve.chat.segments import ImageSegment, Prompt, Segment, TextSegment

__all__ = [
    "K2_INSTRUCT", "K2_THINKING", "K25", "K3", "STOP_TOKEN_ID", "ChatFormat", "ChatOptions", "ImageSegment",
    "Prompt", "Segment", "TextSegment", "chat_format_for",
]
