"""Shared vocabulary used by every layer of k3serve: configs, deterministic hashing, KV-cache event messages,
the HTTP error object."""
