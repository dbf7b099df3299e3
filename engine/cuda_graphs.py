"""Decode windows replayed from CUDA graphs.

A decode window of a MoE model launches some forty small kernels a layer; issued one by one from
Python the GPU waits on the host most of the window. So a window's forward pass (embedding to
logits) is captured once per shape, (rows, attention bucket), and replayed after: one launch.

What a replay relies on:
- its inputs where the capture found them: the `BatchBuilder`'s device buffer (the same slices for the
  same number of rows), the KV caches, the weights, the expert tier's slots and slot tables, all
  written in place;
- nothing in the forward pass syncs the host (a capture that tries fails: graphs are then turned off
  for the run, with a log line, and windows run eagerly);
- the attention length the spans give is the key's (`layers.attend_bucket`);
- entries the experts count on the host (`Experts.counted`) are added again per replay
  (`Experts.recount`); counts kept on the device are counted by the replay itself; `before_replay`
  lets an `Experts` bring its tables up to date first.

The first window of a shape runs eagerly (it compiles the Triton kernels and plans cuBLAS and cuDNN,
which a capture cannot), the second is captured, every later one replayed. A replay launches the
kernels of the eager run, on the same shapes, so a row's tokens are the same either way
(tests/test_cuda_graphs_gpu.py checks the logits bit for bit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.batch import Batch
from engine.experts import ExpertStats
from engine.layers import attend_bucket
from engine.loading import log
from engine.models.base import Model
from engine.replays import Replays

MAX_GRAPHS = 256  # graphs kept (the oldest is dropped past it): rows x buckets for a long context


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the replay's output, [rows, vocab]
    counted: list[ExpertStats]  # what one window counts on the host, per `Experts`
    inputs: int  # the device address of the batch the capture read


class DecodeGraphs(Replays):
    """Captures and replays the decode windows of `model` (one CUDA device, no layer split)."""

    def __init__(self, model: Model):
        super().__init__(model)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._seen: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def usable(model: Model) -> bool:
        return model.device.type == "cuda" and not model.placement.split

    def key(self, batch: Batch) -> tuple[int, int] | None:
        """The window's shape, or None where it runs eagerly: a prompt chunk, or experts that sync."""
        rows = len(batch.spans)
        if self.failed or not batch.single_rows or not all(e.replayable(rows) for e in self.experts):
            return None
        return rows, attend_bucket(batch.spans)

    def run(self, batch: Batch) -> torch.Tensor | None:
        """float32 logits of the window's rows from its graph, or None: the caller runs it eagerly."""
        key = self.key(batch)
        if key is None:
            return None
        graph = self._graphs.get(key)
        if graph is not None and graph.inputs != batch.tokens.data_ptr():  # the builder's buffer grew
            self._graphs.clear()
            graph = None
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                return None
            graph = self._capture(key, batch)
            if graph is None:
                return None
        for e in self.experts:
            e.before_replay()
        graph.graph.replay()
        self.recount(graph.counted)
        self.replays += 1
        return graph.logits.clone()  # the next replay of this graph overwrites its output

    def replay_ms(self, batch: Batch, windows: int = 64) -> float | None:
        """Milliseconds one replay of `batch`'s window takes, the host waiting (the GPU's part of a window:
        what `bench-engine` sets beside a whole window's time); None when its shape was not captured. Give
        it a window already decoded: each replay writes that window's KV entries again."""
        key = self.key(batch)
        graph = self._graphs.get(key) if key is not None else None
        if graph is None or graph.inputs != batch.tokens.data_ptr():
            return None
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(windows):
            graph.graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000 / windows

    def _capture(self, key: tuple[int, int], batch: Batch) -> _Graph | None:
        for e in self.experts:  # what they copy from the host must be copied before the capture
            e.before_replay()
        before = self.counted()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self.model.logits(self.model.forward(batch))
        except RuntimeError as exc:
            self.failed = str(exc).splitlines()[0]
            log(f"CUDA graphs off: capturing a window of {key[0]} rows failed ({self.failed}); "
                f"decode windows run eagerly")
            self._graphs.clear()
            return None
        finally:  # a capture runs nothing: what its Python counted is undone
            counted = self.counted_since(before)
            self.recount([ExpertStats() - entries for entries in counted])
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.pop(next(iter(self._graphs)))
        self.captures += 1
        self._graphs[key] = _Graph(graph, logits, counted, batch.tokens.data_ptr())
        return self._graphs[key]
