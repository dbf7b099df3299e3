"""Decode windows replayed from CPU plans: the CPU's counterpart of engine/cuda_graphs.py.

A CPU decode step of the demo model makes some two hundred kernel calls, and the Python between them costs
~3 ms of a ~16 ms token on the 2-core test machine. So a window's forward pass (embedding to logits) is
recorded once per number of rows (and kernel settings: threads, activations) as the list of its C calls
(engine/kernels/plan.py) and replayed after in one call.

What a replay relies on:
- its inputs where the recording found them: the `BatchBuilder`'s buffer (the same slices for the same
  number of rows: the kernels read the rows' tokens, positions and sessions from it), the KV caches, the
  weights, and the tensors the recorded step allocated (the plan keeps them);
- a step that only calls the kernels: a recording that saw anything else (a torch operation that computes,
  a call a plan cannot hold) turns plans off for the run, with a log line, and windows run eagerly. An
  expert tier is not planned (its layers read their routing on the host and adapt);
- the routed entries each MoE layer counted in Python while the window was recorded, added again per
  replay (`Experts.recount`); the CPU time of a replay's experts is not measured apart, so a replayed
  window adds none to `ExpertStats.cpu_us`.

The first window of a size runs eagerly while it is recorded; every later one replays. A replay makes the
recorded calls with the same arguments, so a row's tokens are the same either way (tests/test_cpu_plans.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.batch import Batch
from engine.experts import ExpertStats
from engine.kernels import cpu
from engine.kernels.plan import Plan, Recording
from engine.loading import log
from engine.models.base import Model
from engine.replays import Replays


@dataclass(frozen=True)
class _Recorded:
    plan: Plan
    logits: torch.Tensor  # the replay's output, [rows, vocab]
    inputs: int  # the address of the batch the recording read
    counted: list[ExpertStats]  # the entries one window counts, per `Experts` (without cpu_us)


class DecodePlans(Replays):
    """Records and replays the decode windows of `model` (CPU, float32, no layer split, no expert tier)."""

    def __init__(self, model: Model):
        super().__init__(model)
        self._plans: dict[tuple[int, int, int], _Recorded] = {}

    @staticmethod
    def usable(model: Model) -> bool:
        return (model.device.type == "cpu" and model.dtype == torch.float32 and not model.placement.split
                and model.tier is None and cpu.available())

    def run(self, batch: Batch, copy: bool = True) -> torch.Tensor | None:
        """float32 logits of the window's rows from its plan (recorded now if it is the first of its size), or
        None: the caller runs it eagerly (a prompt chunk, or plans turned off). `copy` False: the plan's own
        output (~0.2 ms a window less for a 262K vocabulary), which its next replay overwrites."""
        if self.failed or not batch.single_rows or self.model.tier is not None:
            return None
        key = len(batch.spans), cpu.activation_code(), cpu.threads()  # what a recorded call takes as it was
        recorded = self._plans.get(key)
        if recorded is not None and recorded.inputs != batch.tokens.data_ptr():  # the builder's buffer grew
            self._plans.clear()
            recorded = None
        if recorded is None:
            return self._record(key, batch)
        recorded.plan.run()
        self.recount(recorded.counted)
        self.replays += 1
        return recorded.logits.clone() if copy else recorded.logits

    def _record(self, key: tuple[int, int, int], batch: Batch) -> torch.Tensor:
        before = self.counted()
        with Recording() as recording:
            logits = self.model.logits(self.model.forward(batch))
        counted = [replace(entries, cpu_us=0) for entries in self.counted_since(before)]
        if recording.refused:
            self.failed = recording.refused
            self._plans.clear()
            log(f"CPU plans off: a decode window of {key[0]} rows cannot be replayed ({self.failed}); "
                f"decode windows run eagerly")
            return logits
        self._plans[key] = _Recorded(Plan(recording), logits, batch.tokens.data_ptr(), counted)
        self.captures += 1
        return logits.clone()
