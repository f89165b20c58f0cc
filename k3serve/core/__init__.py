"""Shared vocabulary used by every layer of k3serve: configs, deterministic hashing, the HTTP error object."""
