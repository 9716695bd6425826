"""The commit-side kernels over every layer in one launch (the pool's stacked ``[layers, slots, ...]`` buffers,
layers on the grid's last axis) against the same kernels a layer at a time: ``compact_commit`` (chain, tree,
a snapshot into other slots), ``replay_fold`` (in place, into a temporary, a snapshot from the window just
verified, its unsettled fused fold read as the later settle leaves it), ``advance`` (SGLang's
int64 last index + 1, the fused fold's settle) and ``clear_history`` (selected rows, padding, a slot listed
twice). Whole buffers compared bit for bit, padding rows and untouched slots included."""

from dataclasses import fields

import pytest
import torch

from kernel_cases import DEVICE
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit
from sglang_ssm_modes.ops.replay import ReplayRing, advance, clear_history, fold_into_checkpoints, replay_fold

LAYERS, SLOTS, HK, HV, K, V, D, L = 3, 9, 2, 4, 16, 32, 3, 4
RING_SLOTS = SLOTS + 2  # not the state's slot count: a kernel mixing the two per-layer strides cannot pass
STATE_IDX = [4, -1, 0, 7, 2]  # a padding row
DST_IDX = [5, 6, -1, 1, 8]  # snapshot slots (one row without)


def _t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _states(gen, dtype=torch.float32):
    return (torch.randn(LAYERS, SLOTS, HV, V, K, generator=gen) * 0.3).to(dtype).to(DEVICE)


def _ring(gen) -> ReplayRing:
    ring = ReplayRing.allocate(LAYERS * RING_SLOTS, L, HK, HV, K, V, False, torch.bfloat16, DEVICE)
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


def _assert_same(a, b):
    for f in fields(a):
        assert torch.equal(getattr(a, f.name), getattr(b, f.name)), f.name


@pytest.mark.parametrize("tree,snapshot", [(False, False), (False, True), (True, False), (True, True)])
def test_compact_commit_of_every_layer_in_one_launch(tree, snapshot):
    gen = torch.Generator().manual_seed(3 + 2 * tree + snapshot)
    states = _states(gen)
    rec = CompactRecordBuffers(
        k=torch.randn(LAYERS, 6, D, HK, K, generator=gen).to(torch.bfloat16).to(DEVICE),
        v=torch.randn(LAYERS, 6, D, HV, V, generator=gen).to(torch.bfloat16).to(DEVICE),
        g=(-torch.rand(LAYERS, 6, D, HV, 1, generator=gen) * 0.5).to(DEVICE),
        beta=torch.rand(LAYERS, 6, D, HV, generator=gen).to(DEVICE))
    rec_idx = _t([0, 1, 5, 2, 3])
    last = _t([2, 1, 2, -1, 0], torch.int64)  # SGLang's dtype; -1: nothing accepted
    parents = _t([[-1, 0, 0], [-1, 0, 1], [-1, 0, 1], [-1, 0, 0], [-1, 0, 1]], torch.int64) if tree else None
    dst = _t(DST_IDX) if snapshot else None
    one = states.clone()
    compact_commit(one, _t(STATE_IDX), rec, rec_idx, last, is_kda=False, retrieve_parent_token=parents,
                   dst_indices=dst)
    per_layer = states.clone()
    for layer in range(LAYERS):
        compact_commit(per_layer[layer], _t(STATE_IDX), _layer(rec, layer), rec_idx, last, is_kda=False,
                       retrieve_parent_token=parents, dst_indices=dst)
    assert torch.equal(one, per_layer)
    assert not torch.equal(one, states)


@pytest.mark.parametrize("target", ["in place", "temporary", "window steps"])
def test_replay_fold_of_every_layer_in_one_launch(target):
    gen = torch.Generator().manual_seed(11 + len(target))
    states, ring = _states(gen, torch.bfloat16), _ring(gen)
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
    replay_fold(one_states, idx, one_ring, idx, is_kda=False,
                dst=one_out if out is not None else (one_states if snapshot else None), **kwargs)
    layer_states, layer_ring = states.clone(), _clone(ring)
    layer_out = None if out is None else out.clone()
    for layer in range(LAYERS):
        dst = layer_out[layer] if out is not None else (layer_states[layer] if snapshot else None)
        replay_fold(layer_states[layer], idx, _layer(layer_ring, layer), idx, is_kda=False, dst=dst, **kwargs)
    assert torch.equal(one_states, layer_states)
    _assert_same(one_ring, layer_ring)
    if out is not None:
        assert torch.equal(one_out, layer_out) and not torch.equal(one_out, out)
    else:
        assert not torch.equal(one_states, states)
    if snapshot:  # the same snapshots from a cursor settled first (the unsettled fold read as the settle leaves it)
        settled, settled_states = _clone(ring), states.clone()
        advance(settled, idx, 0, window=D)
        replay_fold(settled_states, idx, settled, idx, None, is_kda=False, dst=settled_states,
                    dst_indices=_t(DST_IDX), window_steps=kwargs["window_steps"])
        assert torch.equal(one_states, settled_states)
        assert torch.equal(one_states[:, [4, 0, 7, 2]], states[:, [4, 0, 7, 2]])  # sources only read
        assert torch.equal(one_states[:, 1], states[:, 1])  # the row without a snapshot
    with pytest.raises(ValueError, match="stacked states go with stacked rings"):
        replay_fold(states[0], idx, ring, idx, mask, is_kda=False)


def test_fold_into_checkpoints_of_every_layer():
    gen = torch.Generator().manual_seed(21)
    states, ring = _states(gen), _ring(gen)
    idx, selected = _t(STATE_IDX), _t([1, 1, 0, 1, 1], torch.bool)
    one_states, one_ring = states.clone(), _clone(ring)
    fold_into_checkpoints(one_states, idx, one_ring, idx, selected, is_kda=False)
    layer_states, layer_ring = states.clone(), _clone(ring)
    for layer in range(LAYERS):
        fold_into_checkpoints(layer_states[layer], idx, _layer(layer_ring, layer), idx, selected, is_kda=False)
    assert torch.equal(one_states, layer_states)
    _assert_same(one_ring, layer_ring)
    assert (one_ring.count[:, [4, 7, 2]] == 0).all() and torch.equal(one_ring.count[:, 0], ring.count[:, 0])


@pytest.mark.parametrize("window", [0, D])
def test_advance_of_every_layer_from_sglangs_last_index(window):
    gen = torch.Generator().manual_seed(31 + window)
    ring = _ring(gen)
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
    with pytest.raises(TypeError, match="integers"):
        advance(one, idx, last.float())


@pytest.mark.parametrize("selected", [None, [1, 1, 0, 1, 1]])
def test_clear_history_of_every_layer(selected):
    gen = torch.Generator().manual_seed(41)
    ring = _ring(gen)
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


def test_a_single_stacked_layer_is_served_as_stacked():
    """A pool of one linear layer (a pipeline stage, a small model) stacks ``[1, slots, ...]``: served as stacked,
    the same as that layer's own views; stacked states with another layer count are refused."""
    gen = torch.Generator().manual_seed(51)
    states, ring = _states(gen)[:1].clone(), _ring(gen)
    one_ring = type(ring)(*(getattr(ring, f.name)[:1].clone() for f in fields(ring)))
    idx = _t(STATE_IDX)
    stacked_states, stacked_ring = states.clone(), _clone(one_ring)
    replay_fold(stacked_states, idx, stacked_ring, idx, None, is_kda=False, dst=stacked_states,
                dst_indices=_t(DST_IDX))
    layer_states, layer_ring = states.clone(), _clone(one_ring)
    replay_fold(layer_states[0], idx, _layer(layer_ring, 0), idx, None, is_kda=False, dst=layer_states[0],
                dst_indices=_t(DST_IDX))
    assert torch.equal(stacked_states, layer_states) and not torch.equal(stacked_states, states)
    with pytest.raises(ValueError, match="layer for layer"):
        replay_fold(_states(gen), idx, one_ring, idx, None, is_kda=False)
    rec = CompactRecordBuffers(
        k=torch.randn(1, 6, D, HK, K, generator=gen).to(torch.bfloat16).to(DEVICE),
        v=torch.randn(1, 6, D, HV, V, generator=gen).to(torch.bfloat16).to(DEVICE),
        g=(-torch.rand(1, 6, D, HV, 1, generator=gen) * 0.5).to(DEVICE),
        beta=torch.rand(1, 6, D, HV, generator=gen).to(DEVICE))
    rec_idx, last = _t([0, 1, 5, 2, 3]), _t([2, 1, 2, -1, 0], torch.int64)
    stacked_states, layer_states = states.clone(), states.clone()
    compact_commit(stacked_states, idx, rec, rec_idx, last, is_kda=False)
    compact_commit(layer_states[0], idx, _layer(rec, 0), rec_idx, last, is_kda=False)
    assert torch.equal(stacked_states, layer_states) and not torch.equal(stacked_states, states)
