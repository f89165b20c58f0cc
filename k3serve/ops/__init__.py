"""Functional kernels. Each op lives in ``ops/<op>/`` with a ``naive.py`` reference (the spec) beside its
faster forms; importing this package registers the torch backends with ``ops.registry``."""

from k3serve.ops import kda, mla, moe, mx, registry, short_conv  # noqa: F401
