"""Failure behaviour and observability (DESIGN §7): the ring's fold counters and fault bits as the
kernels leave them (a non-finite fold, a cursor past L), and their report from a running server —
errors naming request, slot and layer, Prometheus counters — without a host synchronisation."""

import logging
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
from sglang.srt.sampling.sampling_params import SamplingParams

from kernel_cases import DEVICE, flat_inputs, make_case, to_device
from sglang_ssm_modes.integration import metrics
from sglang_ssm_modes.integration.metrics import PoolMetrics, PoolObserver
from sglang_ssm_modes.ops.replay import (
    FAULT_NONFINITE, FAULT_OVERFLOW, ReplayRing, advance, after_fold, clear_history, replay_fold, replay_verify,
)
from test_mode_pool import cuda_scratch_on_cpu, make_pool  # noqa: F401 (a fixture)

I32 = dict(dtype=torch.int32, device=DEVICE)


def _ring(slots=4, history=4, hk=1, hv=2, kdim=16, vdim=16):
    return ReplayRing.allocate(slots, history, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)


def test_advance_counts_folds_and_flags_a_cursor_past_the_history():
    ring = _ring()
    ring.count.copy_(torch.tensor([3, 0, 1, 2], **I32))
    rows = torch.tensor([0, 2, -1], **I32)
    advance(ring, rows, torch.tensor([2, 2, 2], **I32), window=2)  # slot 0 folds (3 + 2 > 4), slot 2 does not
    assert ring.count.tolist() == [2, 0, 3, 2] and ring.phase.tolist() == [1, 0, 0, 0]
    assert ring.folds.tolist() == [1, 0, 0, 0] and ring.faults.tolist() == [0, 0, 0, 0]
    advance(ring, torch.tensor([2, 3], **I32), torch.tensor([4, 1], **I32))  # no fold before it: 3 + 4 > L
    assert ring.count.tolist() == [2, 0, 7, 3]
    assert ring.faults.tolist() == [0, 0, FAULT_OVERFLOW, 0]


def test_after_fold_counts_and_clear_history_takes_the_faults_along():
    ring = _ring()
    ring.count.fill_(2)
    ring.faults.copy_(torch.tensor([0, FAULT_NONFINITE, FAULT_OVERFLOW, 0], **I32))
    after_fold(ring, torch.tensor([1, -1, 3], **I32), torch.tensor([True, True, True], device=DEVICE))
    assert ring.folds.tolist() == [0, 1, 0, 1] and ring.count.tolist() == [2, 0, 2, 0]
    clear_history(ring, torch.tensor([1, 2], **I32), torch.tensor([True, False], device=DEVICE))
    assert ring.faults.tolist() == [0, 0, FAULT_OVERFLOW, 0]  # only the selected slot's go
    assert ring.folds.tolist() == [0, 1, 0, 1]  # the counter is cumulative


@pytest.mark.parametrize("fused", [False, True])
def test_a_fold_into_a_non_finite_state_is_written_and_flagged(fused):
    """A NaN record of one request: the fold (fold kernel, or fused into the verify launch) writes what
    the native recurrence gives — non-finite, as native would propagate it — and flags that slot, and
    only that one."""
    n, d, L, hk, hv, kdim, vdim = 3, 2, 4, 1, 2, 16, 16
    params, x, pool, state_idx = make_case("gdn", n, d, hk, hv, kdim, vdim, torch.float32, seed=60)
    state_idx = torch.tensor([0, 2, 4])
    pool = pool.to(DEVICE)
    ring = _ring(n, L, hk, hv, kdim, vdim)
    rows = torch.arange(n, **I32)
    ring.count.fill_(L - 1)  # a window of 2 overflows: every request folds
    ring.g.fill_(-0.1)
    ring.beta.fill_(0.5)
    ring.k_raw.copy_(torch.randn(ring.k_raw.shape, generator=torch.Generator().manual_seed(61)).to(torch.bfloat16))
    ring.v_raw[1, 1, 0, 3] = float("nan")
    if fused:
        inp = to_device(flat_inputs(x, "gdn", n, d), DEVICE)
        replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                      inp["b"], pool, state_idx.to(DEVICE), ring, rows, is_kda=False)
    else:
        replay_fold(pool, state_idx.to(DEVICE), ring, rows, torch.ones(n, dtype=torch.bool, device=DEVICE),
                    is_kda=False)
    assert ring.faults.tolist() == [0, FAULT_NONFINITE, 0]
    assert not pool[2].isfinite().all() and pool[0].isfinite().all() and pool[4].isfinite().all()


def _req(rid, slot):
    req = Req(rid, "", [1, 2], SamplingParams())
    req.mamba_pool_idx = torch.tensor(slot, device=DEVICE)  # as SGLang's MambaSlotAllocator hands it out
    return req


def _sample(registry, name, **labels):
    return registry.get_sample_value(name, {"model_name": "m", **labels})


def test_pool_observer_reports_faults_once_and_fills_the_metrics(caplog):
    pool = make_pool("replay", draft_tokens=1, history=8, device=DEVICE)
    registry = CollectorRegistry()
    observer = PoolObserver(pool, PoolMetrics({"model_name": "m"}, pool, registry=registry))
    rings = pool.replay_rings
    rings.count[0, 2], rings.count[0, 5] = 3, 5
    rings.folds[0, 2], rings.folds[0, 4] = 2, 1
    rings.faults[1, 5] = FAULT_NONFINITE | FAULT_OVERFLOW
    running = [_req("req-a", 2), _req("req-b", 5)]
    # a radix-cache copy: one materialisation
    pool.copy_from(torch.tensor([2], device=DEVICE), torch.tensor([3], device=DEVICE))
    with caplog.at_level(logging.ERROR, logger=metrics.__name__):
        observer.poll(running)  # starts the snapshot (on the CPU its copy is done at once)
        assert not caplog.records
        observer.poll(running)  # reports it, starts the next
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 2 and all("req-b" in e and "slot 5" in e and "linear layer 1" in e for e in errors)
    assert any("non-finite" in e for e in errors) and any("past the history length" in e for e in errors)
    assert rings.faults.sum() == 0, "reported once"
    assert _sample(registry, "sglang:ssm_state_folds_total") == 3
    assert _sample(registry, "sglang:ssm_state_materialised_total") == 1
    assert _sample(registry, "sglang:ssm_state_faults_total", kind="nonfinite") == 1
    assert _sample(registry, "sglang:ssm_state_faults_total", kind="overflow") == 1
    assert _sample(registry, "sglang:ssm_replay_ring_occupancy") == pytest.approx((3 + 5) / (2 * 8))
    assert _sample(registry, "sglang:ssm_state_mode_info", mode="replay", history="8", draft_tokens="1",
                   decode_path="replay", verify_path="none") == 1
    rings.folds[0, 1] = 4
    caplog.clear()
    observer.poll(running)  # reports the snapshot started before the change: one interval late
    assert _sample(registry, "sglang:ssm_state_folds_total") == 3
    observer.poll(running)
    assert _sample(registry, "sglang:ssm_state_folds_total") == 7 and not caplog.records


def test_native_and_compact_pools_have_nothing_device_side_to_read(cuda_scratch_on_cpu):
    for mode in ("native", "compact"):
        pool = make_pool(mode, draft_tokens=1, device=DEVICE)
        observer = PoolObserver(pool)
        observer.poll([])
        observer.poll([])
        assert observer._pending is None


def test_report_decode_stats_polls_the_pool_every_log_interval(monkeypatch):
    """The hook on SGLang's ``SchedulerMetricsReporter.report_decode_stats``: SGLang's own stats run
    first, the pool is read only on log-interval steps, and metrics are created only when SGLang's are on."""
    pool = make_pool("replay", draft_tokens=1, history=8, device=DEVICE)
    polls = []
    monkeypatch.setattr(PoolObserver, "poll", lambda self, running: polls.append((self.metrics, running)))
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    batch = SimpleNamespace(reqs=[_req("r", 1)])
    reporter.scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_pool=pool),
                                         server_args=SimpleNamespace(decode_log_interval=40), running_batch=None)
    reporter.current_scheduler_metrics_enabled = False
    reporter.metrics_collector = None
    calls = []
    original = lambda self, *args, **kwargs: calls.append(args)  # noqa: E731
    for step in (39, 40, 41, 80):
        reporter.forward_ct_decode = step
        metrics.report_decode_stats(original, reporter, True, running_batch=batch)
    assert len(calls) == 4
    assert polls == [(None, batch.reqs), (None, batch.reqs)]
    assert reporter._ssm_pool_observer.pool is pool
