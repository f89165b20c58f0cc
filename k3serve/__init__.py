"""k3serve: a serving stack for Kimi K3-class models (KDA + MLA hybrids, LatentMoE, MXFP4 experts)."""

__version__ = "0.1.0"
