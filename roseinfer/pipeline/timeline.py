"""Reading the stages' timelines: per-step latency, busy time, and the pipeline bubble.

Every stage records a `Span` for each stretch of compute (one micro-batch's prefill or
decode step on that stage). Over a window of time, a stage is busy for the sum of its
spans in it and idle for the rest; the bubble is the idle share of all stages together.
With N equal stages and m micro-batches, a schedule that lets every micro-batch finish
a step before the next step starts idles (N - 1) / (m + N - 1) of the time: the
textbook figure (GPipe) the measurements are held against.
"""

from __future__ import annotations

import statistics

from roseinfer.pipeline.runner import Span, StageReport


def textbook_bubble(n_stages: int, micro_batches: int) -> float:
    """Idle share of N equal stages pushing m micro-batches through, then waiting for all."""
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def job_spans(report: StageReport, job: int, kind: str | None = "decode") -> list[Span]:
    return [s for s in report.timeline if s.job == job and (kind is None or s.kind == kind)]


def bubble(stages: list[StageReport], job: int) -> float:
    """Idle share of the stages while the job's decode steps ran (first start to last end)."""
    spans = [job_spans(report, job) for report in stages]
    start = min(s.start for per_stage in spans for s in per_stage)
    end = max(s.end for per_stage in spans for s in per_stage)
    busy = sum(s.end - s.start for per_stage in spans for s in per_stage)
    return 1.0 - busy / (len(stages) * (end - start))


def step_latencies(stages: list[StageReport], job: int) -> list[float]:
    """Seconds from one decode step of micro-batch 0 to the next, as stage 0 starts them:
    the whole round trip through every stage and back."""
    starts = [s.start for s in job_spans(stages[0], job) if s.group == 0]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def latency_at(latencies: list[float], step: int, around: int = 5) -> float:
    """Median step latency over the steps around `step` (a busy machine wobbles)."""
    window = latencies[max(0, step - around) : step + around + 1]
    return statistics.median(window)
