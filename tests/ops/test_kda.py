"""KDA ops: the chunked prefill and the decode step against the token recurrence (the spec), in fp32.

Gate regimes: "mild" (K3's gate formula on random inputs, mostly slow decay), "k3" (lower bound -5, pushed
hard towards it) and "kimi" (Kimi-Linear's -exp(A_log) * softplus, unbounded below, single steps far past
fp32's exp range). Together they drive every path of the in-chunk decay products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.ops import registry
from k3serve.ops.kda import chunk_kda, intra, kda_decode, naive_kda_decode, naive_recurrent_kda
from k3serve.ops.kda.chunk import auto_chunk_size

TOL = 1e-5
LENGTHS = [1, 7, 63, 65, 128, 130, 300]
CHUNKS = [16, 32, 64]



def make_inputs(B: int, T: int, H: int, K: int, V: int, gate: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    f = torch.randn(B, T, H, K, generator=gen)
    a_log = torch.log(torch.empty(H, 1).uniform_(1, 16, generator=gen))
    if gate == "mild":
        dt = torch.exp(torch.empty(H, K).uniform_(-6.9, -2.3, generator=gen))
        g = -5.0 * torch.sigmoid(a_log.exp() * (f + dt + torch.log(-torch.expm1(-dt))))
    elif gate == "k3":
        g = -5.0 * torch.sigmoid(3.0 * f + 1.0)
    elif gate == "kimi":
        g = -a_log.exp() * F.softplus(4.0 * f)
    else:
        raise AssertionError(gate)
    return q, k, v, g, beta


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    got, ref = got.double(), ref.double()
    err = got - ref
    rms = err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)
    max_abs = err.abs().max() if err.numel() else torch.tensor(0.0)
    assert rms <= tol, f"{name}: relative RMS error {rms:.3e} > {tol:.0e}"
    assert max_abs <= tol * max(1.0, ref.abs().max().item()), f"{name}: max abs error {max_abs:.3e}"


@pytest.mark.parametrize("gate", ["mild", "k3", "kimi"])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrence(T: int, gate: str, with_state: bool) -> None:
    B, H, K, V = 2, 2, 16, 24
    q, k, v, g, beta = make_inputs(B, T, H, K, V, gate, seed=T)
    h0 = torch.randn(B, H, K, V) if with_state else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    for C in CHUNKS:
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=C)
        assert_close(f"o C={C}", o, o_ref)
        assert_close(f"state C={C}", s, s_ref)


def test_gate_regimes_reach_every_decay_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accuracy tests above only mean something if their gates drive all in-chunk paths: whole-chunk
    midpoint blocks (mild), narrower blocks plus the halving recursion (k3), single tokens (kimi)."""
    widths: list[int] = []
    real = intra._diag_blocks

    def spy(q: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        widths.append(q.shape[2])
        return real(q, *args)

    monkeypatch.setattr(intra, "_diag_blocks", spy)
    seen = {}
    for gate in ["mild", "k3", "kimi"]:
        widths.clear()
        chunk_kda(*make_inputs(1, 300, 2, 16, 16, gate, seed=1), chunk_size=64)
        seen[gate] = set(widths)
    assert seen["mild"] == {64}
    assert seen["k3"] and max(seen["k3"]) < 64
    assert seen["kimi"] == set()


def test_varlen_packed_matches_per_sequence() -> None:
    H, K, V = 3, 16, 8
    lens = [65, 1, 0, 130, 7, 63, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta = make_inputs(1, sum(lens), H, K, V, "k3", seed=7)
    h0 = torch.randn(len(lens), H, K, V)
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = naive_recurrent_kda(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[n : n + 1]
        )
        outs.append(o)
        states.append(s)
    o_ref, s_ref = torch.cat(outs, 1), torch.cat(states, 0)
    o_naive, s_naive = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert_close("naive packed o", o_naive, o_ref)
    assert_close("naive packed state", s_naive, s_ref)
    for C in (*CHUNKS, None):  # None: chosen from the lengths
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=C)
        assert_close(f"chunk packed o C={C}", o, o_ref)
        assert_close(f"chunk packed state C={C}", s, s_ref)


def test_auto_chunk_size_trades_padding_for_longer_chunks():
    assert auto_chunk_size([4096]) == 64  # no padding at any size: the fewest hand-off steps
    assert auto_chunk_size([1] * 19 + [336, 384, 304]) == 16  # many short pieces: 64 would pad them 64-fold
    assert auto_chunk_size([96, 96, 96]) == 32  # 64 pads by a third, 32 not at all


@pytest.mark.parametrize("split", [1, 37, 64, 100])
def test_state_handoff(split: int) -> None:
    q, k, v, g, beta = make_inputs(2, 150, 2, 16, 16, "k3", seed=split)
    o_full, s_full = naive_recurrent_kda(q, k, v, g, beta)
    for fn in (naive_recurrent_kda, chunk_kda):
        o1, s1 = fn(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split])
        o2, s2 = fn(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:], initial_state=s1)
        assert_close(f"{fn.__name__} o", torch.cat([o1, o2], 1), o_full)
        assert_close(f"{fn.__name__} state", s2, s_full)


@pytest.mark.parametrize("gate", ["k3", "kimi"])
@pytest.mark.parametrize("in_place", [False, True])
def test_decode_steps_match_recurrence(gate: str, in_place: bool) -> None:
    N, T, H, K, V = 3, 40, 2, 16, 24
    q, k, v, g, beta = make_inputs(N, T, H, K, V, gate, seed=3)
    h0 = torch.randn(N, H, K, V)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, scale=0.3)
    state, outs = h0.clone(), []
    for t in range(T):
        out_state = state if in_place else None
        o, new = kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale=0.3, out_state=out_state)
        assert (new is state) == in_place
        state = new
        outs.append(o)
    assert_close("decode o", torch.stack(outs, 1), o_ref)
    assert_close("decode state", state, s_ref)


def test_prefill_then_decode() -> None:
    q, k, v, g, beta = make_inputs(2, 80, 2, 16, 16, "mild", seed=5)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta)
    o, state = chunk_kda(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70])
    outs = [o]
    for t in range(70, 80):
        o_t, state = kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o_t[:, None])
    assert_close("o", torch.cat(outs, 1), o_ref)
    assert_close("state", state, s_ref)


def test_extreme_gates_stay_finite() -> None:
    """Steps with no decay (g = 0), total forgetting (g = -1e4) and a whole chunk past exp's range."""
    q, k, v, g, beta = make_inputs(1, 130, 2, 16, 16, "k3", seed=9)
    g[:, 10:20] = 0.0
    g[:, 40] = -1e4
    g[:, 64:128, 0] = -200.0
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta)
    for C in CHUNKS:
        o, s = chunk_kda(q, k, v, g, beta, chunk_size=C)
        assert_close(f"o C={C}", o, o_ref)
        assert_close(f"state C={C}", s, s_ref)


def test_low_precision_inputs_return_their_dtype() -> None:
    q, k, v, g, beta = (x.bfloat16() for x in make_inputs(1, 70, 2, 16, 16, "k3", seed=11))
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta)
    o, s = chunk_kda(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close("state", s, s_ref)
    assert_close("o", o.float(), o_ref.float(), tol=1e-2)


def test_empty_sequence_keeps_state() -> None:
    h0 = torch.randn(1, 2, 8, 4)
    z = torch.zeros(1, 0, 2, 8)
    for fn in (naive_recurrent_kda, chunk_kda):
        o, s = fn(z, z, torch.zeros(1, 0, 2, 4), z, torch.zeros(1, 0, 2), initial_state=h0)
        assert o.shape == (1, 0, 2, 4)
        assert torch.equal(s, h0)


def test_bad_inputs_raise_value_error() -> None:
    q, k, v, g, beta = make_inputs(2, 5, 2, 8, 4, "k3", seed=0)
    with pytest.raises(ValueError, match="^k "):
        chunk_kda(q, k[:, :4], v, g, beta)
    with pytest.raises(ValueError, match="^beta "):
        naive_recurrent_kda(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="^initial_state "):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="^cu_seqlens "):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="^cu_seqlens "):
        chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="^chunk_size "):
        chunk_kda(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="^g "):
        chunk_kda(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="^scale "):
        naive_recurrent_kda(q, k, v, g, beta, scale=-1.0)
    state = torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match="^v "):
        kda_decode(q[:, 0], k[:, 0], v[:1, 0], g[:, 0], beta[:, 0], state)
    with pytest.raises(ValueError, match="^state "):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state[..., :3])
    with pytest.raises(ValueError, match="^out_state "):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, out_state=state.mT.contiguous().mT)


def test_registered_backends() -> None:
    assert registry.get("kda_chunk", "naive") is naive_recurrent_kda
    assert registry.get("kda_chunk", "torch") is chunk_kda
    assert registry.get("kda_decode", "torch") is kda_decode
    assert registry.get("kda_decode", "naive") is naive_kda_decode


@pytest.mark.parametrize("in_place", [False, True])
def test_naive_decode_is_one_token_of_the_recurrence(in_place: bool) -> None:
    N, H, K, V = 3, 2, 8, 5
    q, k, v, g, beta = make_inputs(N, 1, H, K, V, "k3", seed=11)
    h0 = torch.randn(N, H, K, V)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, scale=0.3)
    state = h0.clone()
    o, new = naive_kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, scale=0.3,
                              out_state=state if in_place else None)
    assert (new is state) == in_place
    torch.testing.assert_close(o, o_ref[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(new, s_ref, rtol=0, atol=0)
    o_t, s_t = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0, scale=0.3)
    assert_close("torch decode o", o_t, o)
    assert_close("torch decode state", s_t, new)
