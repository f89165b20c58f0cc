"""Model architectures (Kimi K3, Kimi-Linear), checkpoint loading/writing, cache geometry and built-in names."""
