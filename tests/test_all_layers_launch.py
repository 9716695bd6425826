"""The commit-side kernels over every layer in one launch (the pool's stacked ``[layers, slots, ...]`` buffers,
layers on the grid's last axis) against the same kernels a layer at a time: ``compact_commit`` (chain, tree,
a snapshot into other slots), ``replay_fold`` (in place, into a temporary, a snapshot from the window just
verified, its unsettled fused fold read as the later settle leaves it), ``advance`` (SGLang's
int64 last index + 1, the fused fold's settle) and ``clear_history`` (selected rows, padding, a slot listed
twice). Whole buffers compared bit for bit, padding rows and untouched slots included; GDN (scalar gate) and KDA
(per-key-channel gate: ``g`` ``[..., HV, K]`` records, a layer stride K times GDN's), and the committed / folded
states against the float64 references of :mod:`sglang_ssm_modes.reference` (a wrong gate or record stride
that the one-launch and per-layer calls share cannot pass either)."""

from dataclasses import fields

import pytest
import torch

from kernel_cases import DEVICE
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit
from sglang_ssm_modes.ops.replay import (FAULT_OVERFLOW, ReplayRing, advance, clear_history, fold_into_checkpoints,
                                         replay_fold)
from sglang_ssm_modes.reference import CompactRecords, ReplayRecords
from sglang_ssm_modes.reference import compact_commit as reference_commit
from sglang_ssm_modes.reference import fold as reference_fold

LAYERS, SLOTS, HK, HV, K, V, D, L = 3, 9, 2, 4, 16, 32, 3, 4
RING_SLOTS = SLOTS + 2  # not the state's slot count: a kernel mixing the two per-layer strides cannot pass
STATE_IDX = [4, -1, 0, 7, 2]  # a padding row
DST_IDX = [5, 6, -1, 1, 8]  # snapshot slots (one row without)
FAMILIES = ["gdn", "kda"]  # KDA: HK = HV as Kimi-Linear; its gate records [..., HV, K]
RING_WORDS = ("count", "phase", "folds", "faults", "tickets")


def _heads(family):
    """``(HK, Kg)``: key heads and gate channels per value head of the family."""
    return (HV, K) if family == "kda" else (HK, 1)


def _t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _states(gen, dtype=torch.float32):
    return (torch.randn(LAYERS, SLOTS, HV, V, K, generator=gen) * 0.3).to(dtype).to(DEVICE)


def _records(gen, family, layers=LAYERS) -> CompactRecordBuffers:
    hk, kg = _heads(family)
    return CompactRecordBuffers(
        k=torch.randn(layers, 6, D, hk, K, generator=gen).to(torch.bfloat16).to(DEVICE),
        v=torch.randn(layers, 6, D, HV, V, generator=gen).to(torch.bfloat16).to(DEVICE),
        g=(-torch.rand(layers, 6, D, HV, kg, generator=gen) * 0.5).to(DEVICE),
        beta=torch.rand(layers, 6, D, HV, generator=gen).to(DEVICE))


def _ring(gen, family) -> ReplayRing:
    hk, _ = _heads(family)
    ring = ReplayRing.allocate(LAYERS * RING_SLOTS, L, hk, HV, K, V, family == "kda", torch.bfloat16, DEVICE)
    stacked = {f.name: t.view(LAYERS, RING_SLOTS, *t.shape[1:]) for f in fields(ring) for t in [getattr(ring, f.name)]}
    stacked["k_raw"].copy_(torch.randn(stacked["k_raw"].shape, generator=gen))
    stacked["v_raw"].copy_(torch.randn(stacked["v_raw"].shape, generator=gen))
    stacked["g"].copy_(-torch.rand(stacked["g"].shape, generator=gen) * 0.5)
    stacked["beta"].copy_(torch.rand(stacked["beta"].shape, generator=gen))
    stacked["count"].copy_(torch.randint(0, L - D + 1, (LAYERS, RING_SLOTS), generator=gen))
    stacked["phase"].copy_(torch.randint(0, 2, (LAYERS, RING_SLOTS), generator=gen))
    for word in ("folds", "faults", "tickets"):
        stacked[word].copy_(torch.randint(0, 3, (LAYERS, RING_SLOTS), generator=gen))
    return ReplayRing(**stacked)


def _layer(buffers, layer):
    return type(buffers)(*(getattr(buffers, f.name)[layer] for f in fields(buffers)))


def _clone(buffers):
    return type(buffers)(*(getattr(buffers, f.name).clone() for f in fields(buffers)))


def _assert_same(a, b, names=None):
    for f in fields(a):
        if names is None or f.name in names:
            assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


def _records_unchanged(after, before):
    """A ring's records (every buffer but the per-slot words) as they were."""
    _assert_same(after, before, [f.name for f in fields(after) if f.name not in RING_WORDS])


def _close(got, want, what):
    """``got`` (the kernels' states) within float32 rounding of ``want`` (the float64 reference rounded to
    ``got``'s dtype: one bfloat16 ulp where that is the storage)."""
    rtol = 8e-3 if got.dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=rtol * 0.1,
                               msg=lambda m: f"{what}: {m}")


def _expected_commit(states, rec, rec_idx, last, parents, dst, family):
    """What the stacked ``compact_commit`` leaves: per layer and row, the float64 reference commit of the record
    slot's accepted prefix from the row's slot, into its snapshot slot (``dst``) or in place."""
    want = states.double().cpu().clone()
    dst_idx = STATE_IDX if dst is None else dst
    for layer in range(LAYERS):
        for row, (src, to, r, n) in enumerate(zip(STATE_IDX, dst_idx, rec_idx, last)):
            if min(src, to, r, n) < 0:
                continue
            records = CompactRecords(*(getattr(rec, name)[layer, r:r + 1].cpu() for name in ("k", "v", "g", "beta")))
            path = None if parents is None else parents[row:row + 1].cpu()
            want[layer, to] = reference_commit(states[layer, src:src + 1].cpu(), records, torch.tensor([n]), path,
                                               torch.float64)[0].double()
    return want


def _expected_fold(states, ring, dst_states, dst_idx, rows, window_steps=None, window=0):
    """What ``replay_fold`` leaves in ``dst_states`` (a float64 copy): per layer and selected row, the float64
    reference fold of the ring slot's history (``count`` records of its ``phase``'s half, or through step
    ``window_steps[row]`` of the window just verified, its unsettled fold settled first) from the row's slot,
    rounded to the destination's dtype."""
    want = dst_states.double().cpu().clone()
    for layer in range(LAYERS):
        for row in rows:
            src, to = STATE_IDX[row], dst_idx[row]
            count, phase = int(ring.count[layer, src]), int(ring.phase[layer, src])
            if window_steps is not None:
                if count + window > L:
                    count, phase = 0, 1 - phase
                count += window_steps[row] + 1
            span = slice(phase * L, phase * L + count)
            history = ReplayRecords(*(getattr(ring, f.name)[layer, src:src + 1, span].cpu()
                                      for f in fields(ReplayRecords)))
            folded = reference_fold(states[layer, src:src + 1].double().cpu(), history, torch.float64)
            want[layer, to] = folded[0].to(dst_states.dtype).double()
    return want


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree,snapshot", [(False, False), (False, True), (True, False), (True, True)])
def test_compact_commit_of_every_layer_in_one_launch(tree, snapshot, family):
    gen = torch.Generator().manual_seed(3 + 2 * tree + snapshot + 10 * (family == "kda"))
    states = _states(gen)
    rec = _records(gen, family)
    rec_idx = [0, 1, 5, 2, 3]
    last = [2, 1, 2, -1, 0]  # SGLang's dtype (int64); -1: nothing accepted
    parents = _t([[-1, 0, 0], [-1, 0, 1], [-1, 0, 1], [-1, 0, 0], [-1, 0, 1]], torch.int64) if tree else None
    dst = _t(DST_IDX) if snapshot else None
    kda = family == "kda"
    one = states.clone()
    compact_commit(one, _t(STATE_IDX), rec, _t(rec_idx), _t(last, torch.int64), is_kda=kda,
                   retrieve_parent_token=parents, dst_indices=dst)
    per_layer = states.clone()
    for layer in range(LAYERS):
        compact_commit(per_layer[layer], _t(STATE_IDX), _layer(rec, layer), _t(rec_idx), _t(last, torch.int64),
                       is_kda=kda, retrieve_parent_token=parents, dst_indices=dst)
    assert torch.equal(one, per_layer)
    written = [to for src, to, n in zip(STATE_IDX, DST_IDX if snapshot else STATE_IDX, last) if min(src, to, n) >= 0]
    untouched = [s for s in range(SLOTS) if s not in written]
    assert torch.equal(one[:, untouched], states[:, untouched])  # padding, nothing accepted, sources of snapshots
    assert not torch.equal(one[:, written], states[:, written])
    _close(one, _expected_commit(states, rec, rec_idx, last, parents, DST_IDX if snapshot else None, family),
           f"{family} commit")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", ["in place", "temporary", "window steps"])
def test_replay_fold_of_every_layer_in_one_launch(target, family):
    gen = torch.Generator().manual_seed(11 + len(target) + 10 * (family == "kda"))
    kda = family == "kda"
    states, ring = _states(gen, torch.bfloat16), _ring(gen, family)
    ring.count[:, 4] = L - 1  # a verify of D tokens folded this one in its launch (count + D > L), not settled
    idx = _t(STATE_IDX)
    mask = _t([1, 1, 1, 0, 1], torch.bool)
    kwargs, out = dict(mask=mask), None
    if target == "temporary":
        out = torch.zeros(LAYERS, 5, HV, V, K, dtype=torch.bfloat16, device=DEVICE)
        kwargs.update(dst_indices=torch.arange(5, dtype=torch.int32, device=DEVICE))
    elif target == "window steps":  # SGLang's mamba_steps_to_track: -1 for no snapshot
        kwargs = dict(mask=None, dst_indices=_t(DST_IDX), window_steps=_t([1, 0, 2, -1, 2], torch.int64), window=D)
    snapshot = "window_steps" in kwargs
    one_states, one_ring = states.clone(), _clone(ring)
    one_out = None if out is None else out.clone()
    replay_fold(one_states, idx, one_ring, idx, is_kda=kda,
                dst=one_out if out is not None else (one_states if snapshot else None), **kwargs)
    layer_states, layer_ring = states.clone(), _clone(ring)
    layer_out = None if out is None else out.clone()
    for layer in range(LAYERS):
        dst = layer_out[layer] if out is not None else (layer_states[layer] if snapshot else None)
        replay_fold(layer_states[layer], idx, _layer(layer_ring, layer), idx, is_kda=kda, dst=dst, **kwargs)
    assert torch.equal(one_states, layer_states)
    _assert_same(one_ring, layer_ring)
    _assert_same(one_ring, ring)  # a fold moves no cursor and writes no record (finite states: no fault)
    if out is not None:
        assert torch.equal(one_out, layer_out) and not torch.equal(one_out, out)
        assert torch.equal(one_states, states)
        _close(one_out, _expected_fold(states, ring, out, list(range(5)), [0, 2, 4]), f"{family} materialise")
    elif snapshot:
        _close(one_states, _expected_fold(states, ring, states, DST_IDX, [0, 4], [1, 0, 2, -1, 2], D),
               f"{family} snapshot")
    else:
        assert not torch.equal(one_states, states)
        _close(one_states, _expected_fold(states, ring, states, STATE_IDX, [0, 2, 4]), f"{family} fold")
        assert torch.equal(one_states[:, [1, 3, 5, 6, 7, 8]], states[:, [1, 3, 5, 6, 7, 8]])  # 7: masked out
    if snapshot:  # the same snapshots from a cursor settled first (the unsettled fold read as the settle leaves it)
        settled, settled_states = _clone(ring), states.clone()
        advance(settled, idx, 0, window=D)
        replay_fold(settled_states, idx, settled, idx, None, is_kda=kda, dst=settled_states,
                    dst_indices=_t(DST_IDX), window_steps=kwargs["window_steps"])
        assert torch.equal(one_states, settled_states)
        assert torch.equal(one_states[:, [4, 0, 7, 2]], states[:, [4, 0, 7, 2]])  # sources only read
        untouched = [s for s in range(SLOTS) if s not in (5, 8)]  # 6, 1: rows without a source / a step
        assert torch.equal(one_states[:, untouched], states[:, untouched])
    with pytest.raises(ValueError, match="stacked states go with stacked rings"):
        replay_fold(states[0], idx, ring, idx, mask, is_kda=kda)


@pytest.mark.parametrize("family", FAMILIES)
def test_fold_into_checkpoints_of_every_layer(family):
    gen = torch.Generator().manual_seed(21 + 10 * (family == "kda"))
    kda = family == "kda"
    states, ring = _states(gen), _ring(gen, family)
    idx, selected = _t(STATE_IDX), _t([1, 1, 0, 1, 1], torch.bool)
    one_states, one_ring = states.clone(), _clone(ring)
    fold_into_checkpoints(one_states, idx, one_ring, idx, selected, is_kda=kda)
    layer_states, layer_ring = states.clone(), _clone(ring)
    for layer in range(LAYERS):
        fold_into_checkpoints(layer_states[layer], idx, _layer(layer_ring, layer), idx, selected, is_kda=kda)
    assert torch.equal(one_states, layer_states)
    _assert_same(one_ring, layer_ring)
    _close(one_states, _expected_fold(states, ring, states, STATE_IDX, [0, 3, 4]), f"{family} fold")
    assert torch.equal(one_states[:, [0, 1, 3, 5, 6, 8]], states[:, [0, 1, 3, 5, 6, 8]])  # 0: not selected
    _records_unchanged(one_ring, ring)
    folded, kept = [4, 7, 2], [s for s in range(RING_SLOTS) if s not in (4, 7, 2)]
    assert (one_ring.count[:, folded] == 0).all()
    assert torch.equal(one_ring.phase[:, folded], 1 - ring.phase[:, folded])
    assert torch.equal(one_ring.folds[:, folded], ring.folds[:, folded] + 1)
    _assert_same(type(ring)(*(getattr(one_ring, f.name)[:, kept] for f in fields(ring))),
                 type(ring)(*(getattr(ring, f.name)[:, kept] for f in fields(ring))))
    _assert_same(one_ring, ring, ("faults", "tickets"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("window", [0, D])
def test_advance_of_every_layer_from_sglangs_last_index(window, family):
    gen = torch.Generator().manual_seed(31 + window)
    ring = _ring(gen, family)
    ring.count[:, 4] = L - 1  # a slot whose fused fold settles first (count + D > L)
    idx, last = _t(STATE_IDX), _t([2, 2, -1, 0, 1], torch.int64)
    one = _clone(ring)
    advance(one, idx, last, window=window, accepted_offset=1)
    per_layer = _clone(ring)
    for layer in range(LAYERS):
        advance(_layer(per_layer, layer), idx, (last + 1).to(torch.int32), window=window)
    _assert_same(one, per_layer)
    expected = ring.count.clone()
    for slot, n in ((4, 3), (0, 0), (7, 1), (2, 2)):
        expected[:, slot] = (0 if window and slot == 4 else expected[:, slot]) + n
    assert torch.equal(one.count, expected)
    settled = int(window > 0)  # slot 4 settles its fused fold, or (window 0) its count passes L: a fault
    assert torch.equal(one.phase[:, 4], ring.phase[:, 4] ^ settled)
    assert torch.equal(one.folds[:, 4], ring.folds[:, 4] + settled)
    assert torch.equal(one.faults[:, 4], ring.faults[:, 4] | (0 if settled else FAULT_OVERFLOW))
    assert torch.equal(one.tickets, ring.tickets)
    others = [s for s in range(RING_SLOTS) if s != 4]
    for word in ("phase", "folds", "faults", "tickets"):  # no count past L: no fault
        assert torch.equal(getattr(one, word)[:, others], getattr(ring, word)[:, others]), word
    _records_unchanged(one, ring)
    with pytest.raises(TypeError, match="integers"):
        advance(one, idx, last.float())
    scalar, per_row = _clone(ring), _clone(ring)  # one int for every row takes the offset as a tensor does
    advance(scalar, idx, 1, window=window, accepted_offset=1)
    advance(per_row, idx, torch.ones_like(last), window=window, accepted_offset=1)
    _assert_same(scalar, per_row)
    assert torch.equal(scalar.count[:, 0], ring.count[:, 0] + 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("selected", [None, [1, 1, 0, 1, 1]])
def test_clear_history_of_every_layer(selected, family):
    gen = torch.Generator().manual_seed(41)
    ring = _ring(gen, family)
    idx = _t([3, -1, 6, 3, 8])  # a padding row, slot 3 twice
    sel = None if selected is None else _t(selected, torch.bool)
    one = _clone(ring)
    clear_history(one, idx, sel)
    per_layer = _clone(ring)
    for layer in range(LAYERS):
        clear_history(_layer(per_layer, layer), idx, sel)
    _assert_same(one, per_layer)
    cleared = [3, 8] if selected else [3, 6, 8]
    kept = [s for s in range(RING_SLOTS) if s not in cleared]
    for word in ("count", "phase", "faults", "tickets"):
        assert (getattr(one, word)[:, cleared] == 0).all()
        assert torch.equal(getattr(one, word)[:, kept], getattr(ring, word)[:, kept])
    assert torch.equal(one.folds, ring.folds)  # cumulative: a cleared history keeps its fold count
    _records_unchanged(one, ring)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_stacked_layer_is_served_as_stacked(family):
    """A pool of one linear layer (a pipeline stage, a small model) stacks ``[1, slots, ...]``: served as stacked,
    the same as that layer's own views; stacked states with another layer count are refused."""
    gen = torch.Generator().manual_seed(51)
    kda = family == "kda"
    states, ring = _states(gen)[:1].clone(), _ring(gen, family)
    one_ring = type(ring)(*(getattr(ring, f.name)[:1].clone() for f in fields(ring)))
    idx = _t(STATE_IDX)
    stacked_states, stacked_ring = states.clone(), _clone(one_ring)
    replay_fold(stacked_states, idx, stacked_ring, idx, None, is_kda=kda, dst=stacked_states,
                dst_indices=_t(DST_IDX))
    layer_states, layer_ring = states.clone(), _clone(one_ring)
    replay_fold(layer_states[0], idx, _layer(layer_ring, 0), idx, None, is_kda=kda, dst=layer_states[0],
                dst_indices=_t(DST_IDX))
    assert torch.equal(stacked_states, layer_states) and not torch.equal(stacked_states, states)
    with pytest.raises(ValueError, match="layer for layer"):
        replay_fold(_states(gen), idx, one_ring, idx, None, is_kda=kda)
    rec = _records(gen, family, layers=1)
    rec_idx, last = _t([0, 1, 5, 2, 3]), _t([2, 1, 2, -1, 0], torch.int64)
    stacked_states, layer_states = states.clone(), states.clone()
    compact_commit(stacked_states, idx, rec, rec_idx, last, is_kda=kda)
    compact_commit(layer_states[0], idx, _layer(rec, 0), rec_idx, last, is_kda=kda)
    assert torch.equal(stacked_states, layer_states) and not torch.equal(stacked_states, states)
