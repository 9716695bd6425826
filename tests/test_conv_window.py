"""The conv window with rollback by index move (compact / replay) against its plain-torch reference
(bit for bit) and against SGLang 0.5.14's own ``causal_conv1d_update`` (native verify windows +
acceptance), over several speculative rounds with random accepted lengths 0..D, for the GDN layout
and KDA's transposed one. The whole ring, the offsets and the destination pools are compared, padding
rows and untouched slots included.

Two facts of the CPU interpreter shape these tests:

* float32 ``exp`` is not correctly rounded and numpy's (the interpreter's) differs from torch's by an
  ulp on ~40 % of inputs, so the reference is given numpy's ``exp`` to compare SiLU outputs bit for bit;
* the interpreter stores bfloat16 as raw uint16 and does arithmetic on those bits, so SGLang's kernel
  (which multiplies bf16 x bf16 directly) returns garbage for bf16 inputs on the CPU. Its outputs are
  therefore compared bit for bit in the float32 cases, and in the bf16 cases SGLang runs on float32
  copies of the same (bf16-exact) values: its stored windows are then exact, its outputs differ from
  the bf16 path by the rounding of each bf16 x bf16 product (checked within tolerance). Our kernel
  rounds that product on the bits (``_round_to``), so it runs under the interpreter too.
"""

import inspect

import numpy as np
import pytest
import torch

from sglang.srt.layers.attention.mamba.causal_conv1d_triton import causal_conv1d_update

from kernel_cases import DEVICE
from sglang_ssm_modes.ops.conv_window import (conv_ring_commit, conv_ring_load, conv_ring_materialise,
                                              conv_ring_verify, ring_width)
from sglang_ssm_modes.ops.conv_window import kernels as K
from sglang_ssm_modes.reference import conv as R

ON_CPU = DEVICE == "cpu"
C, KW, SLOTS = 48, 4, 9
SLOT_ROWS = [3, 0, -1, 7, 5]  # N = 5 (odd), a padding row in the middle; slots 1, 2, 4, 6, 8 untouched


def _np_exp(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(t.detach().cpu().contiguous().numpy())).to(t.device)


REF_EXP = _np_exp if ON_CPU else torch.exp


def _assert_same(a, b, what, silu=True):
    """Bit for bit; on a GPU the SiLU ``exp`` is the hardware's, so outputs get an ulp of slack."""
    if ON_CPU or not silu:
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"
    else:
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2, msg=what)


def _pool_view(t, transposed):
    """SGLang's ``[slots, conv_dim, K - 1]`` view of a pool (KDA: transpose of ``[slots, K-1, dim]``)."""
    return t.transpose(-1, -2) if transposed else t


def _layout(shape_cm, transposed):
    """Shape ``[..., conv_dim, cols]`` in the layout's storage order."""
    return (*shape_cm[:-2], shape_cm[-1], shape_cm[-2]) if transposed else shape_cm


def _randn(gen, shape, dtype):
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def _sglang_verify(x, weight, bias, state_cm, slot_rows, transposed):
    """SGLang 0.5.14's target-verify conv (as ``GDNAttnBackend.forward_extend`` calls it): outputs
    and the dense ``intermediate_conv_window`` [N, D, conv_dim, K-1]. Runs on a copy of the pool (its
    verify overwrites the pool's conv state with the window's last K-1 inputs; acceptance restores it).
    In bf16 it runs on float32 copies (see the module docstring)."""
    n, _, d = x.shape
    dt = torch.float32
    pool = torch.zeros(_layout((SLOTS, C, KW - 1), transposed), dtype=dt, device=DEVICE)
    pv = _pool_view(pool, transposed)
    real = slot_rows >= 0
    pv[slot_rows[real]] = state_cm[real].to(dt)
    inter = torch.zeros(n, d, C, KW - 1, dtype=dt, device=DEVICE)
    o = causal_conv1d_update(x.to(dt), pv, weight.to(dt), None if bias is None else bias.to(dt), "silu",
                             conv_state_indices=slot_rows.to(torch.int32),
                             intermediate_conv_window=inter,
                             intermediate_state_indices=torch.arange(n, dtype=torch.int32, device=DEVICE))
    return o, inter


CASES = [  # layout (KDA transposed?), conv (ring) dtype, activation dtype, D, bias
    (False, torch.bfloat16, torch.bfloat16, 4, False),  # Qwen3-Next as served (bf16 conv, no bias)
    (False, torch.float32, torch.float32, 3, True),     # bit for bit against SGLang's kernel
    (False, torch.float32, torch.bfloat16, 1, True),    # D = 1: speculative path with no drafts
    (True, torch.bfloat16, torch.bfloat16, 3, False),   # Kimi-Linear layout
    (True, torch.float32, torch.float32, 4, True),
]


@pytest.mark.parametrize("transposed,conv_dtype,act_dtype,d,has_bias", CASES)
def test_ring_rounds_match_reference_and_sglang(transposed, conv_dtype, act_dtype, d, has_bias):
    gen = torch.Generator().manual_seed(7 * d + int(transposed) + 2 * int(has_bias))
    n = len(SLOT_ROWS)
    slot_rows = torch.tensor(SLOT_ROWS, device=DEVICE)
    real = slot_rows >= 0
    w_cols = ring_width(KW, d)
    weight = _randn(gen, (C, KW), act_dtype)
    bias = _randn(gen, (C,), act_dtype) if has_bias else None

    # ring and offsets start as garbage; a prefill's canonical state is loaded (offset 0)
    ring = _randn(gen, _layout((SLOTS, C, w_cols), transposed), conv_dtype)
    offsets = torch.randint(0, w_cols, (SLOTS,), generator=gen, dtype=torch.int32).to(DEVICE)
    prefill = _randn(gen, _layout((SLOTS + 2, C, KW - 1), transposed), conv_dtype)
    src_rows = torch.tensor([4, 1, 0, 10, 2], device=DEVICE)  # canonical source slots; row 2 is padding
    ring_ref, off_ref = R.ring_load(ring, offsets, prefill, src_rows, slot_rows, transposed)
    ring_before = ring.clone()
    conv_ring_load(prefill, src_rows, ring, offsets, slot_rows, transposed=transposed)
    assert torch.equal(ring, ring_ref) and torch.equal(offsets, off_ref)
    untouched = torch.tensor([s for s in range(SLOTS) if s not in SLOT_ROWS], device=DEVICE)
    assert torch.equal(ring[untouched], ring_before[untouched])

    # SGLang's native conv state ([N, conv_dim, K-1] per row), after the same accepted tokens
    native = torch.stack([_pool_view(prefill, transposed)[max(int(s), 0)] for s in src_rows]).to(conv_dtype)

    dst_rows = torch.tensor([6, 2, 0, -1, 5], device=DEVICE)  # row 3 real but not exported
    max_sglang_diff = 0.0
    for rnd in range(3):
        x = _randn(gen, (n, d, C), act_dtype).transpose(1, 2)  # SGLang's [N, conv_dim, T] view
        # ---- verify: kernel vs reference (whole ring), vs SGLang's outputs
        o_ref, ring_ref = R.ring_verify(ring, offsets, slot_rows, x, weight, bias, True, transposed, exp=REF_EXP)
        o = conv_ring_verify(x, weight, bias, ring, offsets, slot_rows, activation="silu", transposed=transposed)
        assert o.shape == x.shape and o.dtype == act_dtype
        _assert_same(o[real], o_ref[real], f"round {rnd} outputs vs reference")
        assert torch.equal(ring, ring_ref), f"round {rnd}: ring after verify"
        assert torch.equal(ring[untouched], ring_before[untouched])
        state_now = torch.stack([R.ring_canonical(ring, offsets, max(int(s), 0), KW, transposed) for s in slot_rows])
        assert torch.equal(state_now[real], native[real]), "verify changed the committed columns"

        o_sgl, inter = _sglang_verify(x, weight, bias, native, slot_rows, transposed)
        o_nat, windows = R.native_conv_update(native, x, weight, bias, True, exp=REF_EXP)
        assert torch.equal(inter[real].to(conv_dtype), windows[real]), "reference windows vs SGLang's"
        if act_dtype == torch.float32:  # SGLang's kernel runs as is: bit for bit
            _assert_same(o_sgl[real], o[real], f"round {rnd} outputs vs SGLang")
        else:  # SGLang ran on float32 copies: only the bf16 product rounding differs
            torch.testing.assert_close(o_sgl[real].float(), o[real].float(), atol=6e-2, rtol=2e-2)
        _assert_same(o_nat[real], o_ref[real], "native reference vs ring reference")
        max_sglang_diff = max(max_sglang_diff, (o_sgl[real].float() - o[real].float()).abs().max().item())

        # ---- accepted lengths 0..D (base token included); the padding row gets one too
        accepted = torch.randint(0, d + 1, (n,), generator=gen).to(DEVICE)
        accepted[rnd % n] = d if int(slot_rows[rnd % n]) >= 0 else accepted[rnd % n]
        accepted[(rnd + 1) % n] = 0 if int(slot_rows[(rnd + 1) % n]) >= 0 else accepted[(rnd + 1) % n]

        # a tracked step, materialised before its commit (advance = accepted) into a checkpoint pool
        track = _randn(gen, _layout((SLOTS, C, KW - 1), transposed), conv_dtype)
        track_ref = R.ring_materialise(ring, offsets, slot_rows, track, dst_rows, KW, transposed, advance=accepted)
        conv_ring_materialise(ring, offsets, slot_rows, track, dst_rows, KW, transposed=transposed, advance=accepted)
        assert torch.equal(track, track_ref)

        # ---- commit: offsets only (whole offsets tensor, padding and untouched slots included)
        off_ref = R.ring_commit(offsets, slot_rows, accepted, w_cols)
        ring_pre = ring.clone()
        conv_ring_commit(offsets, slot_rows, accepted.to(torch.int32), w_cols)
        assert torch.equal(offsets, off_ref), f"round {rnd}: offsets"
        assert torch.equal(ring, ring_pre), "commit moved data"

        # ---- SGLang's acceptance: state := window n - 1 (n = 0: unchanged)
        native = R.native_accept(native, inter.to(conv_dtype), accepted)

        # ---- materialise into a checkpoint / host pool: whole destination compared
        dst = _randn(gen, _layout((SLOTS, C, KW - 1), transposed), conv_dtype)
        dst_ref = R.ring_materialise(ring, offsets, slot_rows, dst, dst_rows, KW, transposed)
        conv_ring_materialise(ring, offsets, slot_rows, dst, dst_rows, KW, transposed=transposed)
        assert torch.equal(dst, dst_ref)
        written = (dst_rows >= 0) & real
        assert torch.equal(_pool_view(dst, transposed)[dst_rows[written]], native[written]), \
            f"round {rnd}: materialised state vs SGLang's native state"
        assert torch.equal(_pool_view(track, transposed)[dst_rows[written]], native[written]), \
            "tracked (advance) state vs the committed one"
        state_now = torch.stack([R.ring_canonical(ring, offsets, max(int(s), 0), KW, transposed) for s in slot_rows])
        assert torch.equal(state_now[real], native[real])
    assert max_sglang_diff < 6e-2


@pytest.mark.parametrize("transposed,d", [(False, 1), (True, 4)])
def test_decode_t1_matches_sglang_decode(transposed, d):
    """Plain decode: T = 1, commit n = 1, against SGLang's decode call (``forward_decode``: 2-D x,
    the pool updated in place), the KDA one through ``conv_states.transpose(-1, -2)``."""
    gen = torch.Generator().manual_seed(3 + d)
    n = len(SLOT_ROWS)
    slot_rows = torch.tensor(SLOT_ROWS, device=DEVICE)
    real = slot_rows >= 0
    w_cols = ring_width(KW, d)
    weight = _randn(gen, (C, KW), torch.float32)
    pool = _randn(gen, _layout((SLOTS, C, KW - 1), transposed), torch.float32)  # SGLang's conv pool
    ring = _randn(gen, _layout((SLOTS, C, w_cols), transposed), torch.float32)
    offsets = torch.zeros(SLOTS, dtype=torch.int32, device=DEVICE)
    everything = torch.arange(SLOTS, device=DEVICE)
    conv_ring_load(pool, everything, ring, offsets, everything, transposed=transposed)
    ones = torch.ones(n, dtype=torch.int32, device=DEVICE)
    for step in range(KW + d):  # enough steps to wrap the ring
        x = _randn(gen, (n, C), torch.float32)
        o_sgl = causal_conv1d_update(x, _pool_view(pool, transposed), weight, None, "silu",
                                     conv_state_indices=slot_rows.to(torch.int32))
        o = conv_ring_verify(x, weight, None, ring, offsets, slot_rows, transposed=transposed)
        assert o.shape == x.shape
        _assert_same(o[real], o_sgl[real], f"decode step {step}")
        conv_ring_commit(offsets, slot_rows, ones, w_cols)
        out = torch.zeros_like(pool)
        conv_ring_materialise(ring, offsets, everything, out, everything, KW, transposed=transposed)
        assert torch.equal(out, pool), f"decode step {step}: whole pool (untouched slots included)"
    assert set(offsets[slot_rows[real]].tolist()) == {(KW + d) % w_cols}
    assert (offsets[[1, 2, 4, 6, 8]] == 0).all()


def test_multi_layer_pool_and_ring_to_ring_copy():
    """All layers at once, as SGLang's ``[layers, slots + 1, ...]`` pools are; commit advances every
    layer; a ring-to-ring copy (radix-cache COW) through ``dst_offsets`` with no temporary."""
    gen = torch.Generator().manual_seed(5)
    layers, d = 3, 3
    w_cols = ring_width(KW, d)
    ring = _randn(gen, (layers, SLOTS, w_cols, C), torch.bfloat16)  # KDA layout
    offsets = torch.randint(0, w_cols, (layers, SLOTS), generator=gen, dtype=torch.int32).to(DEVICE)
    rows = torch.tensor([2, -1, 6], device=DEVICE)
    accepted = torch.tensor([3, 2, 1], dtype=torch.int32, device=DEVICE)
    ref = R.ring_commit(offsets, rows, accepted, w_cols)
    conv_ring_commit(offsets, rows, accepted, w_cols)
    assert torch.equal(offsets, ref)
    dst_rows = torch.tensor([5, 4, -1], device=DEVICE)  # row 1 padding source, row 2 no destination
    ring_copy, off_copy = ring.clone(), offsets.clone()
    conv_ring_materialise(ring, offsets, rows, ring[:, :, :KW - 1], dst_rows, KW, transposed=True,
                          dst_offsets=offsets)
    for layer in range(layers):
        expect = R.ring_canonical(ring_copy[layer], off_copy[layer], 2, KW, True)
        assert torch.equal(R.ring_canonical(ring[layer], offsets[layer], 5, KW, True), expect)
    assert torch.equal(offsets[:, 5], torch.zeros(layers, dtype=torch.int32, device=DEVICE))
    others = [s for s in range(SLOTS) if s != 5]
    assert torch.equal(ring[:, others], ring_copy[:, others]) and torch.equal(offsets[:, others], off_copy[:, others])
    assert torch.equal(ring[:, 5, KW - 1:], ring_copy[:, 5, KW - 1:])  # free columns untouched


def test_verify_refuses_a_window_wider_than_the_ring():
    ring = torch.zeros(SLOTS, C, ring_width(KW, 2), device=DEVICE)
    x = torch.zeros(1, C, 3, device=DEVICE)
    with pytest.raises(ValueError, match="ring columns"):
        conv_ring_verify(x, torch.zeros(C, KW, device=DEVICE), None, ring,
                         torch.zeros(SLOTS, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int64,
                                                                                        device=DEVICE))


def _params(kernel):
    return inspect.signature(kernel.fn).parameters


def _constexprs(kernel):
    return {name for name, p in _params(kernel).items() if "constexpr" in str(p.annotation)}


def _not_specialised(kernel):
    marked = getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize", [])  # JIT / interp.
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in marked}


def test_request_count_and_window_length_are_runtime_values():
    """The request count is the grid (never a constexpr, never an argument of verify); the window
    length and the commit's row count are not specialised: a new batch size or width never recompiles."""
    for kern in (K.conv_ring_verify_kernel, K.conv_ring_commit_kernel, K.conv_ring_materialise_kernel,
                 K.conv_ring_load_kernel):
        names = _constexprs(kern)
        assert names == {n for n in names if n in {"KW", "HAS_BIAS", "SILU", "BLOCK_N", "BLOCK", "NP2_KM1",
                                                   "HAS_ADVANCE", "SET_DST_OFFSET"}}, names
        assert names, "constexpr detection broken"
    assert not any(n in _params(K.conv_ring_verify_kernel) for n in ("N", "B", "batch", "num_requests"))
    assert _not_specialised(K.conv_ring_verify_kernel) == {"T"}
    assert _not_specialised(K.conv_ring_commit_kernel) == {"N"}
