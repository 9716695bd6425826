"""Observability of the mode pool in a running server (DESIGN §7): fault reports and, with
``--enable-metrics``, Prometheus counters — read without ever synchronising the scheduler with the GPU.

The kernels leave what there is to observe in the replay ring (:class:`~sglang_ssm_modes.ops.replay.ReplayRing`):
per slot a cumulative fold counter and fault bits (a fold that produced a non-finite state; a cursor
past L, which cannot happen by construction). Every ``--decode-log-interval`` decode steps, after
SGLang's own decode stats (hook on ``SchedulerMetricsReporter.report_decode_stats``), a
:class:`PoolObserver` packs them into one small device tensor, copies it to pinned host memory
without blocking, and reads the copy it started the interval before, once its event has completed:

* every fault is logged as an error naming the request, the pool slot and the linear layer (and its
  bits are cleared, so it is reported once; a slot's faults also go when it gets a new history);
* with metrics on: ``sglang:ssm_state_folds_total`` (histories folded into their checkpoints),
  ``sglang:ssm_state_materialised_total`` (replay: requests whose canonical state was written for a
  copy or transfer — radix-cache copy-on-write, CPU offload, PD / HiCache transfer, int8 checkpoint;
  extra_buffer's per-step snapshots are not counted),
  ``sglang:ssm_state_faults_total`` (by ``kind``), ``sglang:ssm_replay_ring_occupancy`` (mean history
  length / L over the running requests) and ``sglang:ssm_state_mode_info`` (1, labelled with the mode,
  L, D and the decode and verify kernel paths), with SGLang's own metric labels.
"""

from __future__ import annotations

import logging

import torch

from ..ops.replay import FAULT_NONFINITE, FAULT_OVERFLOW
from ..pool import ModeMambaPool

logger = logging.getLogger(__name__)

FAULT_KINDS = {FAULT_NONFINITE: "nonfinite", FAULT_OVERFLOW: "overflow"}
FAULT_MESSAGES = {
    FAULT_NONFINITE: "a fold of its history produced a non-finite state (written as native would propagate it)",
    FAULT_OVERFLOW: "its replay cursor moved past the history length (a broken ring invariant: please report it)",
}


class PoolMetrics:
    """The Prometheus series of one pool (created in the scheduler process, after SGLang has set up
    its multiprocess metrics directory)."""

    def __init__(self, labels: dict[str, str], pool: ModeMambaPool, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        names = list(labels)
        self.labels = labels
        self.folds = Counter("sglang:ssm_state_folds_total", "Replay histories folded into their checkpoints.",
                             labelnames=names, registry=registry)
        self.materialised = Counter("sglang:ssm_state_materialised_total",
                                    "Requests whose canonical SSM state was written for a copy or transfer.",
                                    labelnames=names, registry=registry)
        self.faults = Counter("sglang:ssm_state_faults_total", "SSM state faults reported (by kind).",
                              labelnames=names + ["kind"], registry=registry)
        self.occupancy = Gauge("sglang:ssm_replay_ring_occupancy",
                               "Mean replay history length / L over the running requests.",
                               labelnames=names, multiprocess_mode="mostrecent", registry=registry)
        info = Gauge("sglang:ssm_state_mode_info", "The SSM state mode and its kernel paths (value 1).",
                     labelnames=names + ["mode", "history", "draft_tokens", "decode_path", "verify_path"],
                     multiprocess_mode="mostrecent", registry=registry)
        cfg = pool.mode_config
        info.labels(**labels, mode=cfg.mode, history=str(cfg.replay_history if cfg.mode == "replay" else 0),
                    draft_tokens=str(cfg.draft_tokens), decode_path=pool.decode_path,
                    verify_path=pool.verify_path if cfg.draft_tokens > 1 else "none").set(1)


class PoolObserver:
    """Reads a :class:`ModeMambaPool`'s fold counters and fault bits one interval late, without a host
    synchronisation; reports faults and (``metrics``) updates :class:`PoolMetrics`."""

    def __init__(self, pool: ModeMambaPool, metrics: PoolMetrics | None = None):
        self.pool = pool
        self.metrics = metrics
        self._pending = None  # (event, [(rid, slot tensor)] of the running requests) of the copy in flight
        self._host = None  # its pinned destination, allocated once
        self._folds = 0
        self._materialised = 0

    def poll(self, running: list) -> None:
        """Report the snapshot started at the previous call if the device has finished it, then start
        one of the pool now. ``running``: SGLang ``Req`` objects of the running batch."""
        if self._pending is not None and self._pending[0].query():
            self._report(self._pending[1])
            self._pending = None
        if self.metrics is not None:
            self.metrics.materialised.labels(**self.metrics.labels).inc(self.pool.materialised - self._materialised)
            self._materialised = self.pool.materialised
        if self._pending is None and self.pool.replay_rings is not None:
            self._pending = self._snapshot(running)

    def _snapshot(self, running: list):
        rings = self.pool.replay_rings
        reqs = [(r.rid, r.mamba_pool_idx) for r in running if getattr(r, "mamba_pool_idx", None) is not None]
        slots = (torch.stack([torch.as_tensor(s, device=rings.count.device).reshape(()) for _, s in reqs]).long()
                 if reqs else torch.zeros(0, dtype=torch.long, device=rings.count.device))
        packed = torch.cat([rings.faults.flatten().long(), rings.folds[0].long().sum().reshape(1),
                            rings.count[0][slots].long().sum().reshape(1)])
        if self._host is None:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=packed.is_cuda)
        self._host.copy_(packed, non_blocking=packed.is_cuda)
        event = torch.cuda.Event() if packed.is_cuda else _DoneEvent()
        event.record()
        return event, reqs

    def _report(self, reqs: list) -> None:
        rings, host = self.pool.replay_rings, self._host
        layers, slots = rings.faults.shape
        faults = host[:layers * slots].view(layers, slots)
        folds, count_sum = int(host[-2]), int(host[-1])
        hit = faults.nonzero().tolist()
        if hit:
            owner = {int(s): rid for rid, s in reqs}
            for layer, slot in hit:
                for bit, message in FAULT_MESSAGES.items():
                    if int(faults[layer, slot]) & bit:
                        logger.error("sglang-ssm-modes: request %s (mamba pool slot %d, linear layer %d): %s",
                                     owner.get(slot, "<no longer running>"), slot, layer, message)
                        if self.metrics is not None:
                            self.metrics.faults.labels(**self.metrics.labels, kind=FAULT_KINDS[bit]).inc()
            where = torch.tensor(hit, device=rings.faults.device).T
            rings.faults[where[0], where[1]] = 0  # reported once
        if self.metrics is not None:
            self.metrics.folds.labels(**self.metrics.labels).inc(max(0, folds - self._folds))
            if reqs:
                self.metrics.occupancy.labels(**self.metrics.labels).set(
                    count_sum / (len(reqs) * self.pool.mode_config.replay_history))
        self._folds = folds


class _DoneEvent:
    """A completed event for a pool on the CPU (tests)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def report_decode_stats(original, self, *args, **kwargs):
    """``SchedulerMetricsReporter.report_decode_stats``: SGLang's stats, then, every
    ``--decode-log-interval`` decode steps, the pool's (:class:`PoolObserver`, created on first use)."""
    result = original(self, *args, **kwargs)
    scheduler = self.scheduler
    pool = getattr(getattr(scheduler, "req_to_token_pool", None), "mamba_pool", None)
    if not isinstance(pool, ModeMambaPool) or self.forward_ct_decode % scheduler.server_args.decode_log_interval:
        return result
    observer = getattr(self, "_ssm_pool_observer", None)
    if observer is None:
        metrics = None
        if self.current_scheduler_metrics_enabled and self.metrics_collector is not None:
            metrics = PoolMetrics(dict(self.metrics_collector.labels), pool)
        observer = self._ssm_pool_observer = PoolObserver(pool, metrics)
    batch = kwargs.get("running_batch") or (args[1] if len(args) > 1 else None) or scheduler.running_batch
    observer.poll(list(getattr(batch, "reqs", None) or []))
    return result
