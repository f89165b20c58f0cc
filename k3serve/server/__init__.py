"""OpenAI/Anthropic-compatible serving frontend (`k3serve serve`).

Two processes: the HTTP server (this package) and the engine core (`k3serve.engine.core`, a child
process), which the server reaches through the engine's one async client (`k3serve.engine.client`,
typed messages of `k3serve.engine.messages` over ZMQ). Module map:
``chat/`` renderers + parsers; ``protocol`` request bodies (+ `to_sampling_params`, the kimi/openai
contracts); ``chat_request`` render/encode/grammar for one chat request; ``chat_serving``,
``completion_serving``, ``anthropic`` responses and SSE streams; ``choice`` ids -> text -> deltas per
choice (text and finish reason through the engine's `SequenceDecoder`); ``generation`` runs a request's
choices (`fan_out`) or a batch at once, disconnects, SSE response; ``grammars`` llguidance grammars;
``media`` images; ``errors``, ``metrics``, ``state``; ``app`` the FastAPI factory.
"""
