"""Run the checks one after another against one endpoint, each under its own timeout (a slow or looping model
fails that check and the run goes on), reporting progress after each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx

from k3serve.verify.checks import CHECKS, Check, Ctx, Fail, Result, Target, Unsupported
from k3serve.verify.client import Client


class EndpointUnreachable(Exception):
    """The endpoint cannot be reached at all; one line for the user."""


async def _model(client: Client, given: str | None) -> str:
    try:
        status, body = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise EndpointUnreachable(f"cannot reach {client.base}: {e.__class__.__name__}: {e}") from None
    if given:
        return given
    if status == 200 and isinstance(body, dict) and body.get("data"):
        return str(body["data"][0].get("id"))
    raise EndpointUnreachable(f"{client.base}/v1/models answered HTTP {status}; name the model with --model")


def select(only: Sequence[str] = (), with_reference: bool = False) -> list[Check]:
    """The checks to run: all (fidelity only with a reference), or those whose id or group is in ``only``."""
    chosen = [c for c in CHECKS if not only or c.id in only or c.group in only]
    unknown = set(only) - {c.id for c in CHECKS} - {c.group for c in CHECKS}
    if unknown:
        raise ValueError(f"only: unknown check {sorted(unknown)[0]!r} (see --list)")
    return [c for c in chosen if with_reference or not c.needs_reference]


async def run_one(chk: Check, ctx: Ctx, timeout_s: float) -> Result:
    t0 = time.perf_counter()
    try:
        detail = await asyncio.wait_for(chk.fn(ctx), timeout_s)
        status = "pass"
    except Fail as e:
        status, detail = "fail", str(e)
    except Unsupported as e:
        status, detail = "unsupported", str(e)
    except asyncio.TimeoutError:
        status, detail = "fail", f"no answer within the check's {timeout_s:g} s timeout"
    except httpx.HTTPError as e:
        status, detail = "error", f"{e.__class__.__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a broken check or a reference failure is reported, not raised
        status, detail = "error", f"{e.__class__.__name__}: {e}"
    return Result(chk.id, chk.group, chk.what, status, detail, time.perf_counter() - t0)


async def run_verify(target: Target, *, only: Sequence[str] = (), transport: httpx.AsyncBaseTransport | None = None,
                     reference=None, progress: Callable[[int, int, Result | None], None] | None = None) -> list[Result]:
    client = Client(target.base_url, api_key=target.api_key, transport=transport,
                    request_timeout=target.timeout_s)
    """``transport``/``reference``: an in-process endpoint and a ready ``verify.reference.Reference`` (tests)."""
    try:
        model = await _model(client, target.model)
        if reference is None and target.reference:
            from k3serve.verify.reference import open_reference

            reference = open_reference(target.reference, target.model, target.api_key)
        ctx = Ctx(target, client, model, reference)
        checks = select(only, with_reference=reference is not None)
        results: list[Result] = []
        if progress:
            progress(0, len(checks), None)
        for i, chk in enumerate(checks):
            results.append(await run_one(chk, ctx, target.timeout_s))
            if progress:
                progress(i + 1, len(checks), results[-1])
        return results
    finally:
        await client.close()
        if reference is not None:
            await reference.close()
