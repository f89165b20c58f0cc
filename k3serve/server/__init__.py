"""OpenAI/Anthropic-compatible serving frontend (`k3serve serve`).

Two processes: the HTTP server (this package) and the engine core (`engine_core`, a child process);
they exchange the typed messages of `messages` over ZMQ. Module map:
``chat/`` renderers + parsers; ``protocol`` request bodies (+ `to_sampling_params`, the kimi/openai
contracts); ``chat_request`` render/encode/grammar for one chat request; ``chat_serving``,
``completion_serving``, ``anthropic`` responses and SSE streams; ``choice`` ids -> text -> deltas per
choice; ``generation`` n-choice fan-out, disconnects, SSE response; ``grammars`` llguidance grammars;
``guided`` masks in the engine process; ``engine_client`` / ``engine_core`` the process boundary;
``media`` images; ``errors``, ``metrics``, ``state``; ``app`` the FastAPI factory.
"""
