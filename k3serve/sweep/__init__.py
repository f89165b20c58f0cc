"""``k3serve sweep``: serve configurations measured for real with bench workloads, plus planner-modelled GPU
layouts, reduced to a Pareto front of throughput vs a latency percentile under SLOs.

    space.py     the sweepable ``k3serve serve`` options, grid parsing, points and their launch commands
    runner.py    one real point: start a server, warm up, run the bench workload, stop it (always)
    modelled.py  Kimi K3 layouts on GPUs this machine lacks, from the planner's rooflines
    front.py     SLOs, eligibility and the Pareto front (measured and modelled apart)
    report.py    points.jsonl (append, resume), front.json, front.png, the terminal table
    cli.py       the subcommand
"""
