"""OpenAI-compatible serving frontend: chat formats, parsers, protocol and HTTP app."""
