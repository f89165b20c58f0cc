"""``k3serve bench``: an async load generator for OpenAI-compatible servers, with the metric definitions of
``vllm bench serve`` (TTFT, TPOT, ITL, E2E latency, throughputs, goodput under SLOs).

    datasets.py  prompts as token ids (random, multi-turn sessions, Mooncake trace replay)
    client.py    one streamed request, timed on the client
    runner.py    arrivals (Poisson / trace timestamps), concurrency cap, progress bar
    metrics.py   per-request metrics and the aggregates
    report.py    summary table and result JSON
    plots.py     latency CDFs and throughput over time (matplotlib)
    cli.py       the subcommand
"""
