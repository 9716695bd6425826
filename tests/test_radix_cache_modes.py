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
as SGLang's chunked kernel does) and a seeded conv window; decode in ``replay`` is the plugin's real
decode hook (SGLang's conv update, then output-only decode and one history record per token, folding
when the ring is full), while ``native`` / ``compact`` decode is SGLang's packed decode kernel, which the
Triton interpreter cannot run as it is, so there the decoded state is set (to a seeded value, or, when
the modes are compared, to replay's canonical state of the same step).

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
from test_mode_pool import HK, HV, KD, LAYERS, VD, gdn_params

MODES = ("native", "compact", "replay")
HISTORY = 8  # replay's L: a ring of 16 records per slot and layer; the 9th decode token folds
CONV_DIM = 2 * HK * KD + HV * VD
FULL_ATTN_LAYER = LAYERS  # one full-attention layer after the linear ones (its KV is never read here)
# Kernel materialisation (float32, tiled) against the plain-torch reference fold (float32, op by op):
# float32 rounding only (observed: max |diff| 3.6e-7 on states of magnitude ~2.8 after 12 tokens).
REF_RTOL, REF_ATOL = 1e-6, 1e-6

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

    def decode(self, batch: ScheduleBatch, inputs, states=None) -> ForwardBatch:
        """One decode step of the batch: ``prepare_for_decode`` (KV for the last sampled token) and the
        forward metadata; replay runs the plugin's decode hook on ``inputs`` (per layer ``(mixed_qkv,
        a, b)``), the other modes take ``states`` ``(temporal [L, bs, ...], conv [L, bs, ...])`` as
        the decoded state (see the module docstring)."""
        batch.prepare_for_decode()
        fb = self.forward_batch(batch)
        if self.mode == "replay":
            for layer, (mixed, a, b) in zip(self.layers, inputs):
                backend_hooks.forward_decode(GDNAttnBackend.forward_decode, self.backend, layer=layer,
                                             forward_batch=fb, mixed_qkv=mixed.clone(), a=a, b=b)
        else:
            slots = self.slots(batch.reqs)
            self.temporal[:, slots] = states[0]
            self.conv[:, slots] = states[1]
        return fb

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
        i32 = idx.to(torch.int32)
        for layer in range(LAYERS):
            replay_fold(self.temporal[layer], i32, self.pool.layer_ring(layer), i32, torch.ones_like(i32, dtype=torch.bool),
                        is_kda=False, dst=out[layer], dst_indices=torch.arange(len(idx), dtype=torch.int32))
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
    """A seeded "decoded" state for the non-replay modes (their decode kernel cannot run here)."""
    slots = world.slots(batch.reqs)
    return (0.9 * world.temporal[:, slots] + 0.05 * torch.randn(world.temporal[:, slots].shape, generator=gen),
            torch.randn(world.conv[:, slots].shape, generator=gen).to(world.conv.dtype))


def run_decode(world: World, batch: ScheduleBatch, steps: int, gen: torch.Generator, first_token: int = 500) -> None:
    for step in range(steps):
        inputs = decode_inputs(gen, len(batch.reqs))
        states = None if world.mode == "replay" else decoded_states(world, batch, gen)
        world.decode(batch, inputs, states)
        world.sample(batch, [first_token + step] * len(batch.reqs))


def serve(world: World, prompts, gen: torch.Generator, decode_steps: int = 0):
    """One request batch from arrival to finish: match, schedule, COW / clear, prefill, sample,
    ``cache_unfinished_req``, ``decode_steps`` decode steps, ``release_kv_cache``. Returns the requests."""
    reqs = [world.new_req(p) for p in prompts]
    world.match(reqs)
    batch = world.schedule(reqs)
    fb = world.forward_batch(batch)
    world.prefill(fb, prefill_noise(gen, len(reqs)))
    world.sample(batch, [400] * len(reqs))
    for req in reqs:
        maybe_cache_unfinished_req(req, world.tree)
    run_decode(world, batch, decode_steps, gen)
    for req in reqs:
        release_kv_cache(req, world.tree)
    return reqs


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
    history of decode records, so the raw checkpoint is not the committed state). Two new requests
    extending either prefix get, through the deferred COW executed by the backend, the canonical state
    of the node they matched, an empty history and SGLang's conv window; the source slots are left
    as they were."""
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
    world.temporal[:, slot_a] = 7.0  # stale contents the deferred clear must remove
    world.conv[:, slot_a] = 7.0
    fb = world.forward_batch(batch)
    assert fb.mamba_clear_indices is None, "the deferred clear was consumed"
    assert (world.temporal[:, slot_a] == 0).all() and (world.conv[:, slot_a] == 0).all()
    assert (world.history([slot_a]) == 0).all()
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

    # --- two new requests: B extends A's whole sequence, C only its prompt -----------------------
    b, c = world.new_req(seq_a + [1, 2, 3]), world.new_req(prompt + [4, 5])
    sources = {"b": slot_a, "c": slot_p}
    want = {"b": world.canonical([slot_a])[:, 0], "c": world.canonical([slot_p])[:, 0]}
    want_conv = {"b": world.conv[:, slot_a].clone(), "c": world.conv[:, slot_p].clone()}
    snap = {k: world.slot_snapshot(s) for k, s in sources.items()}
    world.match([b, c])
    assert len(b.prefix_indices) == len(seq_a) and b.last_node is node_a
    assert len(c.prefix_indices) == len(prompt) and c.last_node is prompt_node
    for name, req in (("b", b), ("c", c)):
        assert int(req.mamba_cow_src_index) == sources[name] and req.mamba_needs_clear is False
    dst = {"b": int(b.mamba_pool_idx), "c": int(c.mamba_pool_idx)}
    dst_before = {k: world.slot_snapshot(s) for k, s in dst.items()}
    batch = world.schedule([b, c])
    assert batch.mamba_cow_src_indices.tolist() == [sources["b"], sources["c"]]
    assert batch.mamba_cow_dst_indices.tolist() == [dst["b"], dst["c"]]
    assert batch.mamba_clear_indices is None
    for k, s in dst.items():  # deferred: nothing copied before the forward
        for name, t in world.slot_snapshot(s).items():
            assert torch.equal(t, dst_before[k][name]), f"{k}: {name} changed before the forward"
    fb = world.forward_batch(batch)
    assert fb.mamba_cow_src_indices is None and fb.mamba_cow_dst_indices is None, "the deferred COW was consumed"
    for k in ("b", "c"):
        assert torch.equal(world.temporal[:, dst[k]], want[k]), f"{mode} {k}: the COW'd state is not canonical"
        assert torch.equal(world.conv[:, dst[k]], want_conv[k])
        assert (world.history([dst[k]]) == 0).all(), f"{k}: the destination starts with an empty history"
        if mode == "replay":
            torch.testing.assert_close(world.temporal[:, dst[k]], world.reference_canonical(sources[k]),
                                       rtol=REF_RTOL, atol=REF_ATOL)
        for name, t in world.slot_snapshot(sources[k]).items():
            assert torch.equal(t, snap[k][name]), f"{k}: the source's {name} changed"
    assert (world.history([slot_a]) == 4).all() if mode == "replay" else True

    # --- B and C run and finish; then everything is evicted: nothing leaks ------------------------
    world.prefill(fb, prefill_noise(gen, 2))
    world.sample(batch, [400, 400])
    for req in (b, c):
        maybe_cache_unfinished_req(req, world.tree)
    run_decode(world, batch, 2, gen)
    for req in (b, c):
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
    assert world.tree.evict(EvictParams(num_tokens=0, mamba_num=world.sizes["mamba"])).mamba_num_evicted == cached_states
    # (a leaf losing its state is deleted with its tokens, and tombstone leaves go with it)
    assert world.tree.evict(EvictParams(num_tokens=world.sizes["tokens"])).num_tokens_evicted == 0
    assert world.tree.total_size() == (0, 0)
    assert world.rtp.mamba_allocator.available_size() == world.sizes["mamba"]
    assert world.alloc.available_size() == world.sizes["tokens"]
    assert world.rtp.available_size() == world.sizes["reqs"]
    world.assert_idle_invariants()
