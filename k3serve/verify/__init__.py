"""``k3serve verify``: pre-flight checks of an OpenAI-compatible endpoint against the Kimi K3 serving contract
(``shared/design/frontend.md`` §3-4, ``chat_format_examples.md`` §3.3), written from the contract, not from
k3serve's server: request-parameter rules, tool calls against their JSON schemas, thinking and reasoning
placement, K3 chat-format features, ``usage.prompt_tokens`` against a local render, stop and finish rules,
images and, with a reference, greedy agreement and logprob KL.

    from k3serve.verify import run_verify
    results = asyncio.run(run_verify(Target("http://127.0.0.1:8000")))

A tool on top of the layering: it imports ``chat``, ``tokenizer`` and (for a local reference) ``engine``.
"""

from k3serve.verify.checks.base import CHECKS, Result, Target
from k3serve.verify.runner import run_verify

__all__ = ["CHECKS", "Result", "Target", "run_verify"]
