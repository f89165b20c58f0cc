"""KV-cache-aware router for hybrid KDA + MLA replicas: KV events, prefix index, policies, trace simulator."""
