"""``learner.compile``: the epoch loop without a host synchronisation per minibatch, its loss
compiled, or its whole minibatch step captured in a CUDA graph.

The eager loop (:func:`learner.minibatch.run_epochs`, mode ``off``) asks the host after every
minibatch whether the loss and the gradient norm are finite. On a GPU that wait, a CPU generator's
permutation copied every epoch, and a few hundred small kernels launched from Python one by one set
the pace of a small MLP's update, not the arithmetic. :class:`MinibatchStep` does the same step with
none of that:

- the finiteness check stays, on the device: a non-finite minibatch sets the fused Adam's
  ``found_inf`` (as AMP's grad scaler does), so it takes no step (weights, moments and step count
  stay as they were), and it is left out of the means and of the EWMA proximal policy's move;
- the sums of the diagnostics, the count of steps taken and the epoch's approx-KL stay on the
  device; the host reads them once per epoch (the early stop on ``target_kl``) and once at the end;
- each minibatch gathers its samples from static copies of the batch's fields with indices on the
  device (the permutation is drawn with the learner's generator as in the eager loop, one copy per
  epoch, so both modes visit the same minibatches in the same order);
- ``graph``: the step (gather, forward, loss, backward, clip, fused Adam, sums) is captured in a
  CUDA graph once per minibatch size and replayed; on a device without CUDA graphs (the CPU) the
  same capture-ready step runs uncaptured, which is what the CPU tests check against eager.
- ``compile``: the loss (forward and backward through AOT autograd) goes through ``torch.compile``.

The modes train the same update as eager: ``off`` and ``graph`` run the same kernels in the same
order; ``compile`` fuses kernels, which may round differently (``tests/test_fast_epochs.py``).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from tensordict import TensorDict
from torch import nn

from learner.minibatch import EpochHooks, LossFn, _total, run_epochs

log = logging.getLogger("tandem.learner")

MODES = ("off", "compile", "graph")
COMPILE_BACKEND = "inductor"   # torch.compile's backend for "compile" (tests use "aot_eager": no C++ build)
MAX_GRAPHS = 4                 # captured graphs kept (one per minibatch size and batch layout)


def resolve_mode(requested: str, device: torch.device, capturable: bool, ranks=None) -> tuple[str, str | None]:
    """The mode a learner runs, and why it differs from `requested` (None when it does not).

    ``auto``: ``graph`` on CUDA for a policy that can be captured, else ``off``. A policy that cannot
    be captured (a Hugging Face model with dynamic shapes) and several learner ranks (DDP's gradient
    hooks) fall back to ``off``; ``graph`` on a device without CUDA graphs runs the capture-ready
    step uncaptured."""
    if requested == "auto":
        return ("graph", None) if device.type == "cuda" and capturable and ranks is None else ("off", None)
    if requested == "off":
        return "off", None
    if ranks is not None:
        return "off", f"learner.compile {requested!r}: several learner ranks (DDP) run the eager loop"
    if not capturable:
        return "off", (f"learner.compile {requested!r}: this policy cannot be captured or compiled "
                       f"(dynamic shapes); the update runs eagerly")
    if requested == "graph" and device.type != "cuda":
        return "graph", f"learner.compile \"graph\": no CUDA graphs on {device}; the capture-ready step runs uncaptured"
    return requested, None


def capturable_policy(policy: nn.Module) -> bool:
    """Whether the update of `policy` can be captured: Tandem's MLP actor-critic (fixed shapes)."""
    return getattr(policy, "capturable", False)


class _CompiledOrEager:
    """A loss through ``torch.compile``; if compiling fails (no C++ compiler for inductor on this
    machine, an op it cannot trace), one line in the log and the loss runs eagerly from then on. The
    failure comes from the first forward pass, before any gradient or optimiser step, so the
    minibatch that met it is simply run again eagerly."""

    def __init__(self, fn: LossFn, key: tuple):
        self.eager, self.key = fn, key
        self.fn = torch.compile(fn, backend=COMPILE_BACKEND, dynamic=False)
        self.checked = False

    def __call__(self, mb):
        if self.checked:
            return self.fn(mb)
        try:
            out = self.fn(mb)
        except Exception as e:   # torch._dynamo / inductor errors have no common public base
            log.warning("learner.compile \"compile\": the loss %s could not be compiled (%s: %s); it runs eagerly",
                        self.key, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
            self.fn = self.eager
            out = self.fn(mb)
        self.checked = True
        return out


class MinibatchStep:
    """One learner's sync-free minibatch step in `mode` (``compile`` or ``graph``), kept across
    updates (the captured graphs with it).

    Args:
        mode: ``compile`` or ``graph``.
        policy, optimizer: the learner's; the optimiser must be a fused (or capturable) Adam, whose
            ``found_inf`` skips a step on the device.
        max_grad_norm: the clip (0: none, the norm is still computed).
    """

    def __init__(self, mode: str, policy: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        if mode not in ("compile", "graph"):
            raise ValueError(f"MinibatchStep: mode {mode!r} is not 'compile' or 'graph'")
        self.mode, self.policy, self.optimizer = mode, policy, optimizer
        self.max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.device = self.params[0].device
        if not optimizer.defaults.get("fused"):
            raise ValueError(f"MinibatchStep: mode {mode!r} needs a fused optimiser (its found_inf skips a step "
                             f"on the device), got {type(optimizer).__name__} without fused=True")
        self.capture = mode == "graph" and self.device.type == "cuda"
        self._graphs: dict[tuple, _Captured] = {}
        self._losses: dict[tuple, LossFn] = {}
        self._layout: tuple | None = None
        self._static: dict[str, torch.Tensor] = {}

    def loss_for(self, key: tuple, make: Callable[[], LossFn]) -> LossFn:
        """The loss function for `key` (e.g. ``("ppo", renormalize)``), made once and kept: the
        compiled code and the captured graphs belong to it."""
        fn = self._losses.get(key)
        if fn is None:
            fn = make()
            if self.mode == "compile":
                fn = _CompiledOrEager(fn, key)
            self._losses[key] = fn
        return fn

    def run(self, fields: dict[str, torch.Tensor], loss_fn: LossFn, n_epochs: int, batch_size: int,
            target_kl: float | None, generator: torch.Generator, hooks: EpochHooks | None = None) -> dict[str, float]:
        """:func:`learner.minibatch.run_epochs`' contract, without a host sync per minibatch.
        `loss_fn` comes from :meth:`loss_for` (the graphs are kept per loss function)."""
        h = hooks if hooks is not None else EpochHooks()
        if h.side_loss is not None:
            raise ValueError("MinibatchStep: a side loss (learner.critic_thread) needs learner.compile \"off\"")
        if self.capture:   # a captured step reads the learning rate from the device (annealing fills it)
            for g in self.optimizer.param_groups:
                g["capturable"] = True   # torch refuses to capture step() otherwise
                if not torch.is_tensor(g["lr"]):
                    g["lr"] = torch.tensor(float(g["lr"]), device=self.device)
                    self._graphs.clear()
        n = next(iter(fields.values())).shape[0]
        acc = _Accumulators(self.device)
        epochs, minibatches, stopped = 0, 0, False
        static, captured = self._static_fields(fields)
        for epoch in range(n_epochs):
            if epoch and h.before_epoch is not None:
                self._refill(static, h.before_epoch())
            epochs += 1
            perm = torch.randperm(n, generator=generator).to(self.device, non_blocking=True)
            acc.start_epoch()
            for start in range(0, n, batch_size):
                if h.should_stop is not None and minibatches and h.should_stop():
                    stopped = True
                    break
                if h.before_minibatch is not None:
                    h.before_minibatch()
                minibatches += 1
                idx = perm[start:start + batch_size]
                if captured:
                    self._replay(static, idx, loss_fn, acc, h.after_step)
                else:
                    self._body(static, idx, loss_fn, acc, h.after_step)
            if stopped or _kl_exceeded(acc, target_kl, h.sync_mean):
                break
        return acc.result(epochs, minibatches, stopped)

    # ---------------------------------------------------------------- one minibatch
    def _replay(self, static: dict[str, torch.Tensor], idx: torch.Tensor, loss_fn: LossFn, acc: _Accumulators,
                after_step) -> None:
        key = (id(loss_fn), idx.numel(), self._layout)
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            captured = self._graphs[key] = _Captured(self, static, idx.numel(), loss_fn, after_step)
        captured.replay(idx, acc)

    def _body(self, static: dict[str, torch.Tensor], idx: torch.Tensor, loss_fn: LossFn, acc: _Accumulators,
              after_step, enabled: torch.Tensor | None = None) -> None:
        """Gather, forward, loss, backward, clip, a fused Adam step skipped on the device where the
        loss or the norm is not finite (or `enabled` is 0), and the sums: no host sync."""
        mb = TensorDict({k: v.index_select(0, idx) for k, v in static.items()}, batch_size=[idx.numel()])
        self.optimizer.zero_grad(set_to_none=True)
        out = loss_fn(mb)
        loss = _total(out)
        loss.backward()
        out["grad_norm"] = nn.utils.clip_grad_norm_(self.params, self.max_norm)
        ok = torch.isfinite(loss.detach() + out["grad_norm"])
        if enabled is not None:
            ok = ok & enabled
        self.optimizer.found_inf = (~ok).float()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        if after_step is not None:
            after_step(ok)
        acc.add(out, ok)

    # ---------------------------------------------------------------- static copies of the batch
    def _static_fields(self, fields: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """The fields this update's steps read, and whether they replay captured graphs. Graphs read
        the same tensors from update to update, refilled in place; a batch whose layout (keys,
        shapes, dtypes) differs from the previous update's runs uncaptured, so a layout is captured
        only once it repeats (PPO's from its second update; GRPO's sample count varies)."""
        if not self.capture:
            return dict(fields), False
        layout = tuple((k, tuple(v.shape), v.dtype) for k, v in fields.items())
        if layout != self._layout:
            self._layout, self._static = layout, {k: v.clone() for k, v in fields.items()}
            self._graphs.clear()
            return dict(fields), False
        self._refill(self._static, fields)
        return self._static, True

    def _refill(self, static: dict[str, torch.Tensor], fields: dict[str, torch.Tensor]) -> None:
        for k, v in fields.items():
            if static[k] is not v:
                if static is self._static:
                    static[k].copy_(v)
                else:
                    static[k] = v


class _Accumulators:
    """Sums of the diagnostics over the steps taken, on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.epoch_kl = torch.zeros((), device=device)
        self.epoch_steps = torch.zeros((), dtype=torch.int64, device=device)

    def start_epoch(self) -> None:
        self.epoch_kl.zero_()
        self.epoch_steps.zero_()

    def add(self, out: dict[str, torch.Tensor], ok: torch.Tensor) -> None:
        for k, v in out.items():
            v = torch.where(ok, v.detach(), torch.zeros((), dtype=v.dtype, device=v.device))
            if k in self.sums:
                self.sums[k].add_(v)
            else:
                self.sums[k] = v.clone()
        self.steps.add_(ok.long())
        self.skipped.add_((~ok).long())
        self.epoch_kl.add_(torch.where(ok, out["approx_kl"].detach().to(self.epoch_kl.dtype), 0.0))
        self.epoch_steps.add_(ok.long())

    def result(self, epochs: int, minibatches: int, stopped: bool) -> dict[str, float]:
        count = max(int(self.steps), 1)
        result = {k: float(v) / count for k, v in self.sums.items()}
        result.update(epochs=epochs, steps=int(self.steps), skipped_steps=int(self.skipped), stopped=int(stopped))
        return result


def _kl_exceeded(acc: _Accumulators, target_kl: float | None, sync_mean) -> bool:
    """The early stop on the epoch's mean approx-KL: the one host read per epoch."""
    if target_kl is None:
        return False
    steps = int(acc.epoch_steps)
    if not steps:
        return False
    kl = acc.epoch_kl / steps
    if sync_mean is not None:
        kl = sync_mean(kl.detach().cpu().double())
    return float(kl) > target_kl


class _Captured:
    """One CUDA graph of :meth:`MinibatchStep._body` for one minibatch size and batch layout: the
    indices and the sums are static tensors it reads and writes; replaying it is one launch."""

    def __init__(self, step: MinibatchStep, static: dict[str, torch.Tensor], size: int, loss_fn: LossFn,
                 after_step):
        self.idx = torch.zeros(size, dtype=torch.int64, device=step.device)
        self.enabled = torch.zeros((), dtype=torch.bool, device=step.device)   # 0 while warming up
        self.acc = _Accumulators(step.device)
        stream = torch.cuda.Stream(step.device)
        stream.wait_stream(torch.cuda.current_stream(step.device))
        with torch.cuda.stream(stream):   # warm-up: lazy state (Adam's moments, cuBLAS) with every step skipped
            for _ in range(2):
                step._body(static, self.idx, loss_fn, self.acc, after_step, self.enabled)
        torch.cuda.current_stream(step.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the learner's receiver thread keeps copying rollouts (from the CUDA-IPC ring:
        # its own copies and syncs) while this thread captures; "global" would fail those calls and
        # invalidate the capture. The receiver's work is on other streams, so none of it is captured.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            step._body(static, self.idx, loss_fn, self.acc, after_step, self.enabled)
        self.enabled.fill_(True)
        log.info("learner.compile graph: captured the minibatch step for %d samples", size)

    def replay(self, idx: torch.Tensor, acc: _Accumulators) -> None:
        self.idx.copy_(idx)
        for t in (self.acc.steps, self.acc.skipped, self.acc.epoch_kl, self.acc.epoch_steps, *self.acc.sums.values()):
            t.zero_()
        self.graph.replay()
        for k, v in self.acc.sums.items():   # into the update's own sums (a few tiny kernels, no sync)
            if k in acc.sums:
                acc.sums[k].add_(v)
            else:
                acc.sums[k] = v.clone()
        for mine, theirs in ((acc.steps, self.acc.steps), (acc.skipped, self.acc.skipped),
                             (acc.epoch_kl, self.acc.epoch_kl), (acc.epoch_steps, self.acc.epoch_steps)):
            mine.add_(theirs)


def epochs_in_mode(step: MinibatchStep | None, policy: nn.Module, optimizer: torch.optim.Optimizer,
                   fields: dict[str, torch.Tensor], loss_fn: LossFn, n_epochs: int, batch_size: int,
                   max_grad_norm: float, target_kl: float | None, generator: torch.Generator,
                   hooks: EpochHooks | None = None) -> dict[str, float]:
    """The eager loop where `step` is None, else `step`'s sync-free one (same arguments and result)."""
    if step is None:
        return run_epochs(policy, optimizer, fields, loss_fn, n_epochs, batch_size, max_grad_norm, target_kl,
                          generator, hooks)
    return step.run(fields, loss_fn, n_epochs, batch_size, target_kl, generator, hooks)
