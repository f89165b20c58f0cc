"""Prefill/decode disaggregation: the hand-off manifest (``manifest``), its transport (``transport``), and the
engine's export/import of a request's caches (``handoff``)."""
