"""The engine: scheduling, cache pools, prefix caching, the model runner, the offline API, and the engine-core
process with its one async client.

Module map: ``sampling_params`` (SamplingParams, the ``n`` fan-out), ``request`` (Request, Batch), ``config``
(EngineConfig), ``memory`` (budget -> pool sizes), ``block_pool`` / ``state_pool`` / ``prefix_cache`` (MLA
blocks, KDA slots and snapshots, the hybrid match), ``scheduler``, ``model_runner`` + ``sampler``,
``logits_processor`` (the per-request hook), ``multimodal`` (image inputs: embeddings, cache keys),
``detokenizer`` (ids -> text, stop strings, a sequence's finish reason), ``engine`` (LLMEngine.step), ``llm``
(offline LLM), ``stats``; the process boundary: ``core`` (the engine-core process), ``client`` (its async
client: the server's, and tests'), ``messages`` (the typed msgspec messages), ``guided`` (llguidance masks in
the core), ``stats_log`` (the core's periodic stats line), ``kv_events`` (KV cache events from the core).
"""
