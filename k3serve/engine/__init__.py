"""The engine: scheduling, cache pools, prefix caching, the model runner, and the offline/async APIs.

Module map: ``sampling_params`` (SamplingParams), ``request`` (Request, Batch), ``config`` (EngineConfig),
``memory`` (budget -> pool sizes), ``block_pool`` / ``state_pool`` / ``prefix_cache`` (MLA blocks, KDA slots
and snapshots, the hybrid match), ``scheduler``, ``model_runner`` + ``sampler``, ``logits_processor`` (the
per-request hook), ``multimodal`` (image inputs: embeddings, cache keys), ``detokenizer``, ``engine``
(LLMEngine.step), ``llm`` (offline LLM), ``async_engine`` (AsyncLLM for the server), ``stats``.
"""
