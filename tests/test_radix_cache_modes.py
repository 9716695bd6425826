"""SGLang 0.5.14's real ``MambaRadixCache`` over a real ``HybridReqToTokenPool`` (built through the
plugin's pool hook) in each state mode, on the CPU, driven the way the scheduler drives it:

* admission: ``Req.init_next_round_input`` (``match_prefix`` with ``cow_mamba``: the request's
  destination slot is allocated, the copy-on-write recorded), ``PrefillAdder.add_one_req`` (locks the
  matched node), ``ScheduleBatch.prepare_for_extend`` (``alloc_for_extend``: request slots and KV with
  eviction under pressure; ``_collect_deferred_mamba_cow_and_clear``);
* forward: ``ForwardBatch.init_new`` and ``GDNAttnBackend.init_forward_metadata``, whose
  ``_execute_deferred_mamba_cow_and_clear`` runs the deferred clear (``mamba_pool.clear_slots``) and
  COW (``mamba_pool.copy_from``); prefill and decode through the plugin's backend hooks;
* results: ``maybe_cache_unfinished_req`` after a prefill (``cache_unfinished_req``: a copy of the
  request's state), ``release_kv_cache`` when a request finishes (``cache_finished_req``: the request's
  slot is donated to the tree), ``evict``.

What runs in place of a model (never in place of the code under test): the prefill writes
``0.5 * state + noise`` into each request's slot (it continues from the prefix state the COW gave it,
as SGLang's chunked kernel does) and a seeded conv window. Decode is the real path in every mode:
the plugin's ``forward_decode`` hook over ``GDNAttnBackend.forward_decode`` on seeded inputs, under
:func:`interpreter_shims.sglang_fla_on_cpu` (what SGLang's FLA kernels need of the Triton interpreter).
``native`` and ``compact`` run SGLang's conv update and packed decode kernel (the hook hands them to
SGLang); ``replay`` runs the hook's own decode — SGLang's conv update, then output-only decode (forced:
a small batch would be written through, leaving no history) and one history record per token, folding
when the ring is full. ``test_modes_agree_after_the_same_operations`` feeds all three the same inputs
and compares their states; the single-mode tests, which check what the cache moves rather than what a
decode computes, may instead give ``native`` / ``compact`` a seeded decoded state (``run_decode``:
cheaper under the interpreter).

The canonical state of a replay slot is computed independently: by materialising checkpoint + history
into a fresh tensor with the fold kernel, and by the plain-torch reference fold
(:func:`sglang_ssm_modes.reference.fold`).
"""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace

import pytest
import torch
import sglang.srt.server_args as sglang_server_args
from sglang.srt.layers.attention.fla.chunk_delta_h import CHUNK_SIZE as FLA_CHUNK_SIZE
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.integration import backend_hooks
from sglang_ssm_modes.ops.replay import replay_fold
from sglang_ssm_modes.pool import ModeMambaPool
from sglang_ssm_modes.pool.mode_pool import init_mode_mamba_pool
from sglang_ssm_modes.reference import ReplayRecords, fold
from sglang_ssm_modes.reference.random_layer import random_gate_params
from interpreter_shims import sglang_fla_on_cpu
from test_mode_pool import HK, HV, KD, LAYERS, VD, gdn_params

MODES = ("native", "compact", "replay")
HISTORY = 8  # replay's L: a ring of 16 records per slot and layer; the 9th decode token folds
CONV_DIM = 2 * HK * KD + HV * VD
FULL_ATTN_LAYER = LAYERS  # one full-attention layer after the linear ones (its KV is never read here)
# Kernel materialisation (float32, tiled) against the plain-torch reference fold (float32, op by op):
# float32 rounding only (observed: max |diff| 3.6e-7 on states of magnitude ~2.8 after 12 tokens).
REF_RTOL, REF_ATOL = 1e-6, 1e-6
# replay's canonical state against native's after the same decodes (replay: output-only decode + fold;
# native: SGLang's packed decode kernel, another op order): the repo's replay tolerance (README, demo,
# test_backend_hooks), |replay - native| <= 1e-5 * max |native| per layer and slot.
REPLAY_REL = 1e-5

_SGLANG_INIT_MAMBA_POOL = HybridReqToTokenPool._init_mamba_pool  # SGLang's own, before any hook


# ---------------------------------------------------------------------------------------------------
# SGLang's process globals: server args (dataclass defaults, no __post_init__, which refuses
# extra_buffer off CUDA) and the parallel topology of one rank (no process group on the CPU)
# ---------------------------------------------------------------------------------------------------

def _server_args(strategy: str):
    args = object.__new__(sglang_server_args.ServerArgs)
    for f in dataclasses.fields(sglang_server_args.ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    args.model_path = "none"  # no model: only the cache, the pools and the backend are built
    args.device = "cpu"
    args.page_size = 1
    args.disable_radix_cache = False
    args.mamba_radix_cache_strategy = strategy
    # ServerArgs.mamba_cache_chunk_size reads the model's hf_config (mamba_chunk_size, else FLA's chunk);
    # there is no model here: the value it computes for a GDN model with page size 1
    args._mamba_cache_chunk_size = FLA_CHUNK_SIZE
    return args


@pytest.fixture
def sglang_globals(monkeypatch, request):
    strategy = getattr(request, "param", "no_buffer")
    args = _server_args(strategy)
    monkeypatch.setattr(sglang_server_args, "_global_server_args", args)
    with get_parallel().override(moe_ep_size=1, tp_size=1, tp_rank=0):
        yield args


# ---------------------------------------------------------------------------------------------------
# One server's worth of SGLang objects in one mode
# ---------------------------------------------------------------------------------------------------

def make_layers(seed: int = 3) -> list[RadixLinearAttention]:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for layer_id in range(LAYERS):
        p = random_gate_params("gdn", HV, KD, gen)
        layers.append(RadixLinearAttention(
            layer_id, HK, HK, HV, KD, KD, VD, conv_weights=torch.randn(CONV_DIM, 4, generator=gen) * 0.5,
            bias=None, activation="silu", A_log=p.A_log, dt_bias=p.dt_bias))
    return layers


class World:
    """SGLang's request / token pools, KV allocator, ``MambaRadixCache``, GDN backend and scheduler
    objects for one state mode, with the helpers that play the scheduler's and the model's parts."""

    def __init__(self, mode: str, monkeypatch, server_args, *, reqs: int = 4, mamba: int = 12, tokens: int = 96,
                 extra_buffer: bool = False, overlap: bool = False):
        self.mode = mode
        cfg = SSMModeConfig(mode=mode, replay_history=HISTORY)
        # replay decodes output-only here, whatever the batch: the path that keeps a history beside the
        # checkpoint, which is what the radix cache must see through (a write-through leaves none)
        monkeypatch.setattr(backend_hooks, "serves_write_through", lambda *args: False)
        monkeypatch.setattr(HybridReqToTokenPool, "_init_mamba_pool",
                            lambda pool, **kw: init_mode_mamba_pool(_SGLANG_INIT_MAMBA_POOL, pool, cfg, **kw))
        self.rtp = HybridReqToTokenPool(
            size=reqs, mamba_size=mamba, mamba_spec_state_size=reqs, max_context_len=160, device="cpu",
            enable_memory_saver=False, cache_params=gdn_params(), mamba_layer_ids=list(range(LAYERS)),
            enable_mamba_extra_buffer=extra_buffer, enable_overlap_schedule=overlap)
        self.pool: ModeMambaPool = self.rtp.mamba_pool
        assert isinstance(self.pool, ModeMambaPool) and self.pool.mode == mode
        self.kv = HybridLinearKVPool(
            size=tokens, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
            full_attention_layer_ids=[FULL_ATTN_LAYER], enable_kvcache_transpose=False, device="cpu",
            mamba_pool=self.rtp.mamba_pool)
        self.alloc = TokenToKVPoolAllocator(size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=self.kv,
                                            need_sort=False)
        self.tree = MambaRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1,
            enable_mamba_extra_buffer=extra_buffer))
        self.runner = SimpleNamespace(device="cpu", server_args=server_args, is_draft_worker=False,
                                      req_to_token_pool=self.rtp, token_to_kv_pool=self.kv,
                                      use_ngram_embedding=False, model_is_mrope=False)
        self.backend = GDNAttnBackend(self.runner)
        self.model_config = SimpleNamespace(vocab_size=1000, is_encoder_decoder=False)
        self.layers = make_layers()
        self.sizes = dict(reqs=reqs, mamba=mamba, tokens=tokens)
        self.rid = 0

    @property
    def temporal(self) -> torch.Tensor:
        return self.pool.mamba_cache.temporal

    @property
    def conv(self) -> torch.Tensor:
        return self.pool.mamba_cache.conv[0]

    # ---- the scheduler's part ----------------------------------------------------------------
    def new_req(self, tokens, max_new_tokens: int = 4) -> Req:
        self.rid += 1
        return Req(rid=f"{self.mode}-{self.rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(max_new_tokens=max_new_tokens))

    def match(self, reqs):
        """``get_new_batch_prefill``: the prefix match of each waiting request (COW recorded)."""
        for req in reqs:
            req.init_next_round_input(self.tree)

    def schedule(self, reqs) -> ScheduleBatch:
        """``PrefillAdder`` (locks the matched nodes) and ``prepare_for_extend`` (slots, KV, deferred
        COW / clear collected)."""
        adder = PrefillAdder(1, self.tree, self.alloc, None, 0.0, 10 ** 6, None)
        for req in reqs:
            assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
        batch = ScheduleBatch.init_new(reqs, self.rtp, self.alloc, self.tree, self.model_config, False,
                                       SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        return batch

    def forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """``ForwardBatch.init_new`` + ``init_forward_metadata``: the deferred clear / COW run here."""
        fb = ForwardBatch.init_new(batch, self.runner)
        self.backend.init_forward_metadata(fb)
        return fb

    def sample(self, batch: ScheduleBatch, tokens) -> None:
        for req, tok in zip(batch.reqs, tokens):
            req.output_ids.append(int(tok))

    # ---- the model's part --------------------------------------------------------------------
    def prefill(self, fb: ForwardBatch, noise) -> None:
        """Every linear layer through the plugin's ``forward_extend`` hook (replay: fold the batch's
        histories first); in place of SGLang's chunked kernel, ``0.5 * state + noise`` per slot.
        ``noise``: per layer ``(temporal [bs, HV, V, K], conv [bs, CONV_DIM, 3])``."""
        for layer, (temporal_noise, conv_noise) in zip(self.layers, noise):
            def chunked_kernel(backend, *, layer, forward_batch, mixed_qkv, a, b, **kwargs):
                cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
                idx = backend.forward_metadata.mamba_cache_indices.long()
                cache.temporal[idx] = 0.5 * cache.temporal[idx] + temporal_noise
                cache.conv[0][idx] = conv_noise.to(cache.conv[0].dtype)
                return mixed_qkv

            mixed = torch.zeros(int(fb.extend_num_tokens), CONV_DIM, dtype=torch.bfloat16)
            backend_hooks.forward_extend(chunked_kernel, self.backend, layer=layer, forward_batch=fb,
                                         mixed_qkv=mixed, a=None, b=None)

    def decode(self, batch: ScheduleBatch, inputs, states=None) -> list[torch.Tensor] | None:
        """One decode step of the batch: ``prepare_for_decode`` (KV for the last sampled token), the
        forward metadata, then every linear layer through the plugin's ``forward_decode`` hook over
        ``GDNAttnBackend.forward_decode`` on ``inputs`` (per layer ``(mixed_qkv, a, b)``) under
        :func:`sglang_fla_on_cpu` — SGLang's conv update and packed decode in native / compact, the
        hook's replay decode in replay; returns the per-layer outputs. Only where ``states``
        ``(temporal [L, bs, ...], conv [L, bs, ...])`` is given (native / compact, single-mode tests)
        is no decode run: that is then the decoded state (see the module docstring); returns None."""
        batch.prepare_for_decode()
        fb = self.forward_batch(batch)
        if states is not None:
            assert self.mode != "replay", "replay always decodes through its hook"
            slots = self.slots(batch.reqs)
            self.temporal[:, slots] = states[0]
            self.conv[:, slots] = states[1]
            return None
        outputs = []
        with sglang_fla_on_cpu():
            for layer, (mixed, a, b) in zip(self.layers, inputs):
                outputs.append(backend_hooks.forward_decode(GDNAttnBackend.forward_decode, self.backend, layer=layer,
                                                            forward_batch=fb, mixed_qkv=mixed.clone(), a=a, b=b))
        return outputs

    # ---- inspection --------------------------------------------------------------------------
    @staticmethod
    def slots(reqs) -> torch.Tensor:
        return torch.stack([r.mamba_pool_idx for r in reqs]).long()

    def canonical(self, slots) -> torch.Tensor:
        """The committed state ``[L, n, HV, V, K]`` of ``slots``: replay materialises checkpoint +
        history into a fresh tensor with the fold kernel; the other modes' state is canonical."""
        idx = torch.as_tensor(slots).long().flatten()
        if self.pool.replay_rings is None:
            return self.temporal[:, idx].clone()
        out = torch.empty(LAYERS, len(idx), *self.temporal.shape[2:], dtype=self.temporal.dtype)
        i32, everything = idx.to(torch.int32), torch.ones(len(idx), dtype=torch.bool)
        for layer in range(LAYERS):
            replay_fold(self.temporal[layer], i32, self.pool.layer_ring(layer), i32, everything, is_kda=False,
                        dst=out[layer], dst_indices=torch.arange(len(idx), dtype=torch.int32))
        return out

    def reference_canonical(self, slot: int) -> torch.Tensor:
        """``[L, HV, V, K]``: the plain-torch reference fold of checkpoint + history (replay)."""
        out = []
        for layer in range(LAYERS):
            ring = self.pool.layer_ring(layer)
            c, base = int(ring.count[slot]), int(ring.phase[slot]) * ring.history
            w = slice(base, base + c)
            rec = ReplayRecords(u=ring.u[slot:slot + 1, w], k_norm=ring.k_norm[slot:slot + 1, w],
                                g=ring.g[slot:slot + 1, w], beta=ring.beta[slot:slot + 1, w],
                                k_raw=ring.k_raw[slot:slot + 1, w], v_raw=ring.v_raw[slot:slot + 1, w])
            out.append(fold(self.temporal[layer, slot:slot + 1], rec)[0])
        return torch.stack(out)

    def history(self, slots) -> torch.Tensor:
        """``[L, n]`` history lengths (0 outside replay)."""
        idx = torch.as_tensor(slots).long().flatten()
        if self.pool.replay_rings is None:
            return torch.zeros(LAYERS, len(idx), dtype=torch.int32)
        return self.pool.replay_rings.count[:, idx].clone()

    def slot_snapshot(self, slot: int) -> dict:
        """Everything the pool holds for one slot (checkpoint / state, conv, ring and cursor)."""
        snap = {"temporal": self.temporal[:, slot].clone(), "conv": self.conv[:, slot].clone()}
        if self.pool.replay_rings is not None:
            for name, t in self.pool.replay_rings.buffers().items():
                snap[name] = t[:, slot].clone()
        return snap

    def matched_node(self, tokens):
        """The node a request for ``tokens`` (plus one new token) would copy its state from."""
        key = list(tokens) + [999]
        result = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", key), None, limit=len(key) - 1)))
        return result.last_device_node

    def assert_idle_invariants(self) -> None:
        """What SGLang's ``SchedulerInvariantChecker`` checks at idle, page by page: every mamba slot and
        token is free or held by the tree, never both; every request slot is free; the LRU lists agree."""
        tree, mamba = self.tree, self.rtp.mamba_allocator
        assert self.rtp.available_size() == self.sizes["reqs"], "request slots leaked"
        assert (mamba.available_size() + tree.mamba_evictable_size() + tree.mamba_protected_size()
                == self.sizes["mamba"]), "mamba slots leaked"
        assert tree.mamba_protected_size() == 0 and tree.full_protected_size() == 0, "a lock was not released"
        free_mamba, cached_mamba = mamba.free_slots.tolist(), tree.all_mamba_values_flatten().tolist()
        assert len(free_mamba) == len(set(free_mamba)) and not set(free_mamba) & set(cached_mamba)
        assert set(free_mamba) | set(cached_mamba) == set(range(1, self.sizes["mamba"] + 1))
        free_tok = self.alloc.free_pages.tolist() + self.alloc.release_pages.tolist()
        cached_tok = tree.all_values_flatten().long().tolist()
        assert len(free_tok) == len(set(free_tok)) and not set(free_tok) & set(cached_tok)
        assert set(free_tok) | set(cached_tok) == set(range(1, self.sizes["tokens"] + 1)), "tokens leaked"
        tree.sanity_check()


# ---------------------------------------------------------------------------------------------------
# Seeded model stand-ins
# ---------------------------------------------------------------------------------------------------

def prefill_noise(gen: torch.Generator, bs: int):
    return [(torch.randn(bs, HV, VD, KD, generator=gen) * 0.1, torch.randn(bs, CONV_DIM, 3, generator=gen))
            for _ in range(LAYERS)]


def decode_inputs(gen: torch.Generator, bs: int):
    return [(torch.randn(bs, CONV_DIM, generator=gen).to(torch.bfloat16),
             torch.randn(bs, HV, generator=gen).to(torch.bfloat16),
             torch.randn(bs, HV, generator=gen).to(torch.bfloat16)) for _ in range(LAYERS)]


def decoded_states(world: World, batch: ScheduleBatch, gen: torch.Generator):
    """A seeded "decoded" state for the non-replay modes in the single-mode tests, which check what the
    cache moves, not what a decode computes (their real decode runs in ``test_modes_agree_…``)."""
    slots = world.slots(batch.reqs)
    return (0.9 * world.temporal[:, slots] + 0.05 * torch.randn(world.temporal[:, slots].shape, generator=gen),
            torch.randn(world.conv[:, slots].shape, generator=gen).to(world.conv.dtype))


def run_decode(world: World, batch: ScheduleBatch, steps: int, gen: torch.Generator, first_token: int = 500) -> None:
    for step in range(steps):
        inputs = decode_inputs(gen, len(batch.reqs))
        states = None if world.mode == "replay" else decoded_states(world, batch, gen)
        world.decode(batch, inputs, states)
        world.sample(batch, [first_token + step] * len(batch.reqs))


def full_sequence(req: Req) -> list[int]:
    """The tokens ``cache_finished_req`` inserted for ``req`` (its committed KV)."""
    return list((req.origin_input_ids + req.output_ids)[:req.kv_committed_len])


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_insert_match_cow(mode, sglang_globals, monkeypatch):
    """A request is cached twice (its prompt by ``cache_unfinished_req`` after the prefill, its whole
    sequence by ``cache_finished_req`` at the end, donating its slot: in replay a checkpoint with a
    history of decode records, so the raw checkpoint is not the committed state). New requests
    extending either prefix (two of them hitting the same node in one batch) get, through the deferred
    COW executed by the backend, the canonical state of the node they matched, an empty history and
    SGLang's conv window; the source slots (checkpoint, ring, cursor) are left as they were; the
    deferred clear of a fresh request empties a reused slot."""
    world = World(mode, monkeypatch, sglang_globals)
    gen = torch.Generator().manual_seed(11)
    prompt = list(range(100, 108))

    # --- request A: admission clears its fresh slot, the prefill writes it ---------------------
    a = world.new_req(prompt)
    world.match([a])
    assert a.mamba_pool_idx is None and len(a.prefix_indices) == 0, "empty tree: nothing matched"
    batch = world.schedule([a])
    assert a.mamba_needs_clear is False and batch.mamba_clear_indices.tolist() == [int(a.mamba_pool_idx)]
    assert batch.mamba_cow_src_indices is None
    slot_a = int(a.mamba_pool_idx)
    world.temporal[:, slot_a] = 7.0  # stale contents (a previous owner's) the deferred clear must remove
    world.conv[:, slot_a] = 7.0
    if mode == "replay":
        world.pool.replay_rings.count[:, slot_a] = 3
        world.pool.replay_rings.phase[:, slot_a] = 1
    fb = world.forward_batch(batch)
    assert fb.mamba_clear_indices is None, "the deferred clear was consumed"
    assert (world.temporal[:, slot_a] == 0).all() and (world.conv[:, slot_a] == 0).all()
    assert (world.history([slot_a]) == 0).all()
    if mode == "replay":
        assert (world.pool.replay_rings.phase[:, slot_a] == 0).all()
    world.prefill(fb, prefill_noise(gen, 1))
    world.sample(batch, [400])

    # --- cache_unfinished_req: the prompt goes to the tree as a copy of A's state ------------------
    before_copy = world.canonical([slot_a])
    maybe_cache_unfinished_req(a, world.tree)
    prompt_node = world.matched_node(prompt)
    assert a.last_node is prompt_node and len(prompt_node.key) == len(prompt)
    slot_p = int(prompt_node.mamba_value)
    assert slot_p != slot_a, "no_buffer: the tree keeps a copy, the request keeps its slot"
    assert torch.equal(world.temporal[:, slot_p], before_copy[:, 0])
    assert (world.history([slot_p]) == 0).all()

    # --- decode: replay keeps a history beside its checkpoint -------------------------------------
    run_decode(world, batch, 4, gen)
    canonical_a = world.canonical([slot_a])[:, 0]
    if mode == "replay":
        assert (world.history([slot_a]) == 4).all()
        assert not torch.allclose(world.temporal[:, slot_a], canonical_a, atol=1e-3), \
            "the raw checkpoint must differ from the committed state for this test to mean anything"
        torch.testing.assert_close(world.reference_canonical(slot_a), canonical_a, rtol=REF_RTOL, atol=REF_ATOL)

    # --- cache_finished_req: the slot itself (checkpoint + history) is donated ---------------------
    req_slots_free = world.rtp.available_size()
    release_kv_cache(a, world.tree)
    assert a.req_pool_idx is None
    assert slot_a not in world.rtp.mamba_allocator.free_slots.tolist(), "donated to the tree, not freed"
    assert world.rtp.available_size() == req_slots_free + 1
    seq_a = full_sequence(a)
    assert len(seq_a) == len(prompt) + 4
    node_a = world.matched_node(seq_a)
    assert int(node_a.mamba_value) == slot_a and node_a.parent is prompt_node
    world.assert_idle_invariants()

    # --- new requests: B extends A's whole sequence, C only its prompt, D is a second hit on A's ----
    # --- node in the same batch (one source, two destinations) -------------------------------------
    reqs = {"b": world.new_req(seq_a + [1, 2, 3]), "c": world.new_req(prompt + [4, 5]),
            "d": world.new_req(seq_a + [6])}
    b, c, d = reqs.values()
    sources = {"b": slot_a, "c": slot_p, "d": slot_a}
    want = {k: world.canonical([s])[:, 0] for k, s in sources.items()}
    want_conv = {k: world.conv[:, s].clone() for k, s in sources.items()}
    snap = {k: world.slot_snapshot(s) for k, s in sources.items()}
    world.match(list(reqs.values()))
    assert len(b.prefix_indices) == len(d.prefix_indices) == len(seq_a) and b.last_node is d.last_node is node_a
    assert len(c.prefix_indices) == len(prompt) and c.last_node is prompt_node
    for name, req in reqs.items():
        assert int(req.mamba_cow_src_index) == sources[name] and req.mamba_needs_clear is False
    dst = {k: int(r.mamba_pool_idx) for k, r in reqs.items()}
    dst_before = {k: world.slot_snapshot(s) for k, s in dst.items()}
    batch = world.schedule(list(reqs.values()))
    assert batch.mamba_cow_src_indices.tolist() == [sources[k] for k in reqs]
    assert batch.mamba_cow_dst_indices.tolist() == [dst[k] for k in reqs]
    assert batch.mamba_clear_indices is None
    for k, s in dst.items():  # deferred: nothing copied before the forward
        for name, t in world.slot_snapshot(s).items():
            assert torch.equal(t, dst_before[k][name]), f"{k}: {name} changed before the forward"
    fb = world.forward_batch(batch)
    assert fb.mamba_cow_src_indices is None and fb.mamba_cow_dst_indices is None, "the deferred COW was consumed"
    for k in reqs:
        assert torch.equal(world.temporal[:, dst[k]], want[k]), f"{mode} {k}: the COW'd state is not canonical"
        assert torch.equal(world.conv[:, dst[k]], want_conv[k])
        assert (world.history([dst[k]]) == 0).all(), f"{k}: the destination starts with an empty history"
        if mode == "replay":
            torch.testing.assert_close(world.temporal[:, dst[k]], world.reference_canonical(sources[k]),
                                       rtol=REF_RTOL, atol=REF_ATOL)
        for name, t in world.slot_snapshot(sources[k]).items():
            assert torch.equal(t, snap[k][name]), f"{k}: the source's {name} changed"
    if mode == "replay":
        assert (world.history([slot_a]) == 4).all(), "the donated slot keeps its history"

    # --- B, C and D run and finish; then everything is evicted: nothing leaks ----------------------
    world.prefill(fb, prefill_noise(gen, 3))
    world.sample(batch, [400] * 3)
    for req in reqs.values():
        maybe_cache_unfinished_req(req, world.tree)
    run_decode(world, batch, 2, gen)
    for req in reqs.values():
        release_kv_cache(req, world.tree)
    world.assert_idle_invariants()
    world.tree.evict(EvictParams(num_tokens=world.sizes["tokens"], mamba_num=world.sizes["mamba"]))
    assert world.tree.total_size() == (0, 0)
    assert world.rtp.mamba_allocator.available_size() == world.sizes["mamba"]
    assert world.alloc.available_size() == world.sizes["tokens"]
    world.assert_idle_invariants()


def _dirty(world: World, slot: int) -> bool:
    return bool(world.temporal[:, slot].any() or world.conv[:, slot].any() or world.history([slot]).any())


@pytest.mark.parametrize("mode", MODES)
def test_eviction_under_pressure_leaks_nothing(mode, sglang_globals, monkeypatch):
    """Small pools (2 request slots, 6 mamba slots, 40 tokens) and a stream of requests, some
    extending earlier ones: admissions evict mamba states (``alloc_req_slots`` wants 3 free per
    request) and tokens (``alloc_token_slots``), a match with no free mamba slot evicts one itself,
    and ``evict`` empties the tree at the end. At every idle point each slot and token is free or held
    by the tree (SGLang's invariant checker, page by page). Every reused slot — replay: one freed with a
    history — reaches its new owner zeroed with an empty history (deferred clear of a new request) or
    holding the canonical state with an empty history (COW into a request; ``cache_unfinished_req``'s
    copy into the tree)."""
    world = World(mode, monkeypatch, sglang_globals, reqs=2, mamba=6, tokens=40)
    gen = torch.Generator().manual_seed(23)
    reused = {"clear": 0, "cow": 0, "insert": 0, "with_history": 0}

    def free_dirty() -> dict[int, bool]:
        """Free slots that hold something -> whether that includes a history."""
        return {s: bool(world.history([s]).any()) for s in world.rtp.mamba_allocator.free_slots.tolist()
                if _dirty(world, s)}

    finished = []
    prompts = [list(range(10 * i, 10 * i + 6)) for i in range(1, 7)]
    for i, prompt in enumerate(prompts):
        if i in (2, 4):  # extend the previous request's whole sequence: a COW from its donated slot
            prompt = full_sequence(finished[-1]) + [7, 8]
        req = world.new_req(prompt)
        dirty = free_dirty()
        world.match([req])
        if req.mamba_cow_src_index is not None:
            src, dst = int(req.mamba_cow_src_index), int(req.mamba_pool_idx)
            want = world.canonical([src])[:, 0]
        batch = world.schedule([req])
        slot = int(req.mamba_pool_idx)
        fb = world.forward_batch(batch)
        if req.last_node.mamba_value is not None and len(req.prefix_indices):  # COW
            assert slot == dst and torch.equal(world.temporal[:, slot], want)
            kind = "cow"
        else:  # deferred clear
            assert (world.temporal[:, slot] == 0).all() and (world.conv[:, slot] == 0).all()
            kind = "clear"
        assert (world.history([slot]) == 0).all(), f"{kind}: a reused slot starts with an empty history"
        if slot in dirty:
            reused[kind] += 1
            reused["with_history"] += dirty[slot]
        world.prefill(fb, prefill_noise(gen, 1))
        world.sample(batch, [400])

        dirty, want = free_dirty(), world.canonical([slot])[:, 0]
        maybe_cache_unfinished_req(req, world.tree)
        copy = int(req.last_node.mamba_value)
        assert copy != slot and torch.equal(world.temporal[:, copy], want)
        assert (world.history([copy]) == 0).all(), "insert: the tree's copy starts with an empty history"
        if copy in dirty:
            reused["insert"] += 1
            reused["with_history"] += dirty[copy]

        run_decode(world, batch, 3, gen)
        release_kv_cache(req, world.tree)
        finished.append(req)
        world.assert_idle_invariants()

    assert min(reused["clear"], reused["cow"], reused["insert"]) > 0, reused
    if mode == "replay":
        assert reused["with_history"] > 0, f"no slot was reused with a history: the test lost its point {reused}"
    assert world.matched_node(prompts[0]) is world.tree.root_node, "the oldest prefix was evicted"

    # --- a match with every free mamba slot held by running requests evicts one itself ---------------
    held = world.rtp.mamba_allocator.alloc(world.rtp.mamba_allocator.available_size())
    assert world.rtp.mamba_allocator.available_size() == 0
    cached_before = world.tree.total_size()[1]
    extend = full_sequence(finished[-1]) + [9]
    req = world.new_req(extend)
    world.match([req])
    node = req.last_node
    assert node.mamba_value is not None and req.mamba_pool_idx is not None
    assert world.tree.total_size()[1] == cached_before - 1, "one cached state evicted to make room"
    world.rtp.mamba_allocator.free(held)
    want = world.canonical([node.mamba_value])[:, 0]
    batch = world.schedule([req])
    fb = world.forward_batch(batch)
    assert torch.equal(world.temporal[:, int(req.mamba_pool_idx)], want)
    world.prefill(fb, prefill_noise(gen, 1))
    world.sample(batch, [400])
    maybe_cache_unfinished_req(req, world.tree)
    release_kv_cache(req, world.tree)
    world.assert_idle_invariants()

    # --- evict everything: every slot and token back on the free lists ----------------------------------
    cached_states, cached_tokens = world.tree.total_size()[1], world.tree.full_evictable_size()
    assert cached_states > 0 and cached_tokens > 0
    evicted = world.tree.evict(EvictParams(num_tokens=0, mamba_num=world.sizes["mamba"]))
    assert evicted.mamba_num_evicted == cached_states
    # (a leaf losing its state is deleted with its tokens, and tombstone leaves go with it)
    assert world.tree.evict(EvictParams(num_tokens=world.sizes["tokens"])).num_tokens_evicted == 0
    assert world.tree.total_size() == (0, 0)
    assert world.rtp.mamba_allocator.available_size() == world.sizes["mamba"]
    assert world.alloc.available_size() == world.sizes["tokens"]
    assert world.rtp.available_size() == world.sizes["reqs"]
    world.assert_idle_invariants()


def _tree_states(world: World) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """Every cached state by its token path: ``(canonical temporal [L, HV, V, K], conv [L, ...])``."""
    out, stack = {}, [(world.tree.root_node, ())]
    while stack:
        node, path = stack.pop()
        if node is not world.tree.root_node:
            path = path + tuple(node.key.raw_token_ids())
            if node.mamba_value is not None:
                slot = int(node.mamba_value)
                out[path] = (world.canonical([slot])[:, 0], world.conv[:, slot].clone())
        stack.extend((child, path) for child in node.children.values())
    return out


def assert_replay_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """States ``[..., HV, V, K]``: replay's ``got`` within :data:`REPLAY_REL` of native's ``want``, relative to
    ``max |want|`` of each leading index (layer, slot); where ``want`` is all zero, ``got`` must be too."""
    err = (got - want).abs().flatten(-3).amax(-1)
    scale = want.abs().flatten(-3).amax(-1)
    bad = err > REPLAY_REL * scale
    assert not bad.any(), (
        f"{what}: replay differs from native at (layer, slot) {bad.nonzero().tolist()}: max |diff| "
        f"{err.max().item():.3g}, relative {(err / scale.clamp_min(1e-30)).max().item():.3g} > {REPLAY_REL}")


def test_modes_agree_after_the_same_operations(sglang_globals, monkeypatch):
    """The three modes through the same requests in lockstep (same slots, same seeded prefill noise and
    decode inputs). Every mode decodes through the real path (``World.decode``: the plugin's hook over
    ``GDNAttnBackend.forward_decode`` under ``sglang_fla_on_cpu`` — SGLang's packed decode in native and
    compact, output-only decode + history + folds in replay), and after every decode step, every prefill
    and every step's releases the whole pool is compared — every slot, free, cached or running, untouched
    ones included: canonical states (replay: checkpoint + history materialised) of compact bit for bit
    equal to native's and of replay within :data:`REPLAY_REL` (1e-5 relative, float32), conv windows bit
    for bit; each step's decode outputs too (compact bit for bit, replay within bfloat16 rounding).
    Requests extending cached prefixes — one of them past a replay fold (10 decode tokens, L = 8) —
    receive through the COW the same state in every mode; so is every state the tree holds, and every
    mode's tree is emptied by ``evict`` with nothing leaked."""
    worlds = {m: World(m, monkeypatch, sglang_globals, reqs=4, mamba=16, tokens=160) for m in MODES}
    replay = worlds["replay"]
    gen = torch.Generator().manual_seed(31)

    def assert_same(what, states):
        assert torch.equal(states["compact"], states["native"]), f"{what}: compact differs from native"
        assert_replay_close(what, states["replay"], states["native"])

    def assert_pools_agree(what):
        """Every slot of every pool: canonical state and conv window."""
        every = torch.arange(worlds["native"].temporal.shape[1])
        assert_same(f"{what} (whole pool)", {m: w.canonical(every) for m, w in worlds.items()})
        for m in ("compact", "replay"):
            assert torch.equal(worlds[m].conv, worlds["native"].conv), f"{what}: {m}'s conv windows differ"

    def step(prompts, decode_steps):
        reqs = {m: [w.new_req(p) for p in prompts] for m, w in worlds.items()}
        batches, fbs = {}, {}
        for m, w in worlds.items():
            w.match(reqs[m])
            batches[m] = w.schedule(reqs[m])
        slots = World.slots(reqs["replay"])
        cow = {m: (b.mamba_cow_src_indices, b.mamba_cow_dst_indices) for m, b in batches.items()}
        for m, w in worlds.items():
            assert torch.equal(World.slots(reqs[m]), slots), "lockstep: the same slots in every mode"
            fbs[m] = w.forward_batch(batches[m])
        received = {m: w.canonical(slots) for m, w in worlds.items()}  # what the COW / clear gave
        noise = prefill_noise(gen, len(prompts))
        for m, w in worlds.items():
            w.prefill(fbs[m], noise)
            w.sample(batches[m], [400] * len(prompts))
            for req in reqs[m]:
                maybe_cache_unfinished_req(req, w.tree)
        assert_pools_agree(f"prefill of {len(prompts)} requests")
        for t in range(decode_steps):
            inputs = decode_inputs(gen, len(prompts))
            outputs = {m: w.decode(batches[m], inputs) for m, w in worlds.items()}
            for layer in range(LAYERS):
                assert torch.equal(outputs["compact"][layer], outputs["native"][layer]), f"decode {t}: outputs"
                torch.testing.assert_close(outputs["replay"][layer].float(), outputs["native"][layer].float(),
                                           rtol=2e-2, atol=2e-2)  # bfloat16 outputs
            assert_pools_agree(f"decode step {t}")
            for m, w in worlds.items():
                w.sample(batches[m], [500 + t] * len(prompts))
        for m, w in worlds.items():
            for req in reqs[m]:
                release_kv_cache(req, w.tree)
            w.assert_idle_invariants()
        assert_pools_agree("release")
        return reqs["replay"], cow, received

    (a, _), _, _ = step([list(range(100, 110)), list(range(200, 207))], decode_steps=10)
    assert (replay.history([a.mamba_pool_idx]) == 10 - HISTORY).all(), "replay folded (10 tokens > L = 8)"
    seq_a = full_sequence(a)
    # C extends A's whole sequence (donated slot: checkpoint + history), D only B's prompt (a copy)
    c, cow, received = step([seq_a + [1, 2], list(range(200, 207)) + [3]], decode_steps=3)
    for m in MODES:
        assert cow[m][0] is not None and len(cow[m][0]) == 2, f"{m}: both requests copied a cached state"
    assert_same("COW of a donated slot and of a prompt copy", received)
    # E extends C's whole sequence: a COW from a slot whose own state came from a COW
    _, cow, received = step([full_sequence(c[0]) + [4]], decode_steps=2)
    assert all(cow[m][0] is not None for m in MODES)
    assert_same("COW of a COW'd request's donated slot", received)

    trees = {m: _tree_states(w) for m, w in worlds.items()}
    assert trees["native"].keys() == trees["compact"].keys() == trees["replay"].keys()
    assert len(trees["native"]) >= 7
    for path in trees["native"]:
        assert_same(f"cached state of {len(path)} tokens", {m: trees[m][path][0] for m in MODES})
        assert torch.equal(trees["replay"][path][1], trees["native"][path][1])
        assert torch.equal(trees["compact"][path][1], trees["native"][path][1])

    for m, w in worlds.items():
        w.tree.evict(EvictParams(num_tokens=0, mamba_num=w.sizes["mamba"]))
        assert w.tree.total_size() == (0, 0)
        assert w.rtp.mamba_allocator.available_size() == w.sizes["mamba"]
        assert w.alloc.available_size() == w.sizes["tokens"]
        w.assert_idle_invariants()


@pytest.fixture
def pinned_memory_on_cpu(monkeypatch):
    """``prepare_for_decode`` with ``extra_buffer`` builds its track indices / mask in pinned host
    memory, which needs the CUDA driver; on the CPU only that allocation becomes a plain one (nothing
    moves where CUDA exists)."""
    if torch.cuda.is_available():
        return
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)


@pytest.mark.parametrize("sglang_globals", ["extra_buffer"], indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_extra_buffer_prefill_track_slot(mode, sglang_globals, monkeypatch, pinned_memory_on_cpu):
    """``extra_buffer`` (SGLang's server refuses it off CUDA; the cache, pools and scheduler code run
    here): request Z decodes and finishes (its working slot, replay: with a history of decode records,
    goes back to the free list: extra_buffer frees the working slot at finish); request A, a 64-token
    prompt (one FLA chunk: tracked), gets that slot as its ping-pong track slot; SGLang's extend
    tracking copies A's prefill state into it, ``cache_unfinished_req`` donates it to the tree, and a
    request B extending A's prompt must receive exactly that tracked state through the COW."""
    world = World(mode, monkeypatch, sglang_globals, reqs=2, mamba=4, tokens=160, extra_buffer=True,
                  overlap=True)
    gen = torch.Generator().manual_seed(41)

    # --- Z: a short request (no tracking) that decodes and finishes -----------------------------
    z = world.new_req(list(range(10, 16)))
    world.match([z])
    batch = world.schedule([z])
    z_slot = int(z.mamba_pool_idx)
    assert z.mamba_ping_pong_track_buffer.tolist() == [2, 3] and z_slot == 1
    fb = world.forward_batch(batch)
    world.prefill(fb, prefill_noise(gen, 1))
    world.sample(batch, [400])
    maybe_cache_unfinished_req(z, world.tree)  # nothing tracked yet: nothing cached
    run_decode(world, batch, 2, gen)
    if mode == "replay":
        assert (world.history([z_slot]) == 2).all()
    release_kv_cache(z, world.tree)
    assert world.rtp.mamba_allocator.free_slots.tolist() == [4, 1, 2, 3], "every Z slot back on the free list"
    world.assert_idle_invariants()

    # --- A: 64 tokens; its track slot is Z's old working slot -----------------------------------
    prompt = list(range(1000, 1000 + FLA_CHUNK_SIZE))
    a = world.new_req(prompt)
    world.match([a])
    batch = world.schedule([a])
    track = int(a.mamba_ping_pong_track_buffer[0])
    assert track == z_slot and a.mamba_last_track_seqlen == FLA_CHUNK_SIZE
    assert batch.mamba_track_mask.tolist() == [True] and batch.mamba_track_indices.tolist() == [track]
    fb = world.forward_batch(batch)
    md = world.backend.forward_metadata
    assert md.track_ssm_final_dst.tolist() == [track] and md.track_ssm_final_src.tolist() == [int(a.mamba_pool_idx)]

    noise = prefill_noise(gen, 1)
    for layer, (temporal_noise, conv_noise) in zip(world.layers, noise):
        def chunked_kernel_then_track(backend, *, layer, forward_batch, mixed_qkv, a, b, **kwargs):
            """SGLang's chunked kernel (stand-in: as ``World.prefill``), then SGLang's own tracking of
            the chunk-aligned state into the track slot (``_track_mamba_state_extend``)."""
            cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
            idx = backend.forward_metadata.mamba_cache_indices.long()
            cache.temporal[idx] = 0.5 * cache.temporal[idx] + temporal_noise
            cache.conv[0][idx] = conv_noise.to(cache.conv[0].dtype)
            h = torch.zeros(1, 1, *cache.temporal.shape[1:])  # per-chunk states: only the final one is tracked
            backend._track_mamba_state_extend(forward_batch, h, cache.temporal, backend.forward_metadata)
            return mixed_qkv

        backend_hooks.forward_extend(chunked_kernel_then_track, world.backend, layer=layer, forward_batch=fb,
                                     mixed_qkv=torch.zeros(FLA_CHUNK_SIZE, CONV_DIM, dtype=torch.bfloat16),
                                     a=None, b=None)
    tracked = world.temporal[:, track].clone()
    assert torch.equal(tracked, world.temporal[:, int(a.mamba_pool_idx)]), "SGLang tracked A's prefill state"
    world.sample(batch, [400])
    maybe_cache_unfinished_req(a, world.tree)  # extra_buffer: the track slot itself goes to the tree
    node = world.matched_node(prompt)
    assert int(node.mamba_value) == track and len(node.key) == FLA_CHUNK_SIZE
    release_kv_cache(a, world.tree)
    world.assert_idle_invariants()

    # --- B extends A's prompt: the COW must hand over the tracked state ---------------------------
    b = world.new_req(prompt + [1, 2])
    world.match([b])
    assert int(b.mamba_cow_src_index) == track
    batch = world.schedule([b])
    world.forward_batch(batch)
    dst = int(b.mamba_pool_idx)
    assert (world.history([dst]) == 0).all()
    assert torch.equal(world.temporal[:, dst], tracked), (
        f"a cache hit received a state A never had (max |diff| "
        f"{(world.temporal[:, dst] - tracked).abs().max().item():.3g}); the tracked slot's history: "
        f"{world.history([track]).flatten().tolist()}")
    assert (world.history([track]) == 0).all()
