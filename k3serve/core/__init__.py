"""Shared vocabulary used by every layer of k3serve: configs and deterministic hashing."""
