"""Human-readable counts and sizes whose unit fits the number: 2,779.9B / 11.7M params, 1,560.9 GB / 23.4 MB.

The planner serves models from a few million parameters (k3-default) to a few trillion (Kimi K3); one fixed
unit prints one end of that range as "0.0".
"""

from __future__ import annotations

_COUNT = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_DECIMAL = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _scaled(x: float, units: tuple[tuple[float, str], ...], sep: str, base: str, small_digits: int = 1) -> str:
    # T and TB only from 10 T up, so Kimi K3's 2,779.9B params and 1,560.9 GB keep the units of its
    # published figures
    for scale, unit in units:
        if abs(x) >= scale * (10 if unit in ("T", "TB") else 1):
            digits = small_digits if abs(x) < 10 * scale else 1
            return f"{x / scale:,.{digits}f}{sep}{unit}"
    return f"{x:,.0f}{sep}{base}".rstrip()


def count(n: float) -> str:
    """Parameters: ``2,779.9B``, ``104.2B``, ``11.7M``, ``786.4K``, ``192``."""
    return _scaled(n, _COUNT, "", "")


def nbytes(b: float) -> str:
    """Decimal bytes: ``1,560.9 GB``, ``23.4 MB``, ``4.2 KB``, ``512 B``."""
    return _scaled(b, _DECIMAL, " ", "B")


def nbytes_binary(b: float) -> str:
    """Binary bytes: ``1.42 TiB``, ``27.0 GiB``, ``428.6 MiB``, ``13.5 KiB``, ``512 B`` (three significant
    digits below 10, where it mostly stands beside a decimal figure: ``1,560.9 GB (1.42 TiB)``)."""
    return _scaled(b, _BINARY, " ", "B", small_digits=2)
