"""Deployment planning: analytic parameter/byte/cache model of a config, sourced GPU table, and the planner
behind ``k3serve plan`` and ``k3serve params``."""
