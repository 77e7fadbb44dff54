"""A model split across processes, each stage with its own layers' KV cache.

Read in this order: `stage.py` (which layers a stage holds, the stage module built from
the GPT's own modules, its cache indexed locally), `runner.py` (the messages between
stages, stage 0's driver, micro-batches), `launch.py` (starting and stopping the stage
processes: torch.multiprocessing spawn or torchrun).
"""

from roseinfer.pipeline.launch import PipelineJob, PipelineRun, PipelineSetup, run_pipeline
from roseinfer.pipeline.stage import PipelineStage, stage_layers

__all__ = [
    "PipelineJob",
    "PipelineRun",
    "PipelineSetup",
    "PipelineStage",
    "run_pipeline",
    "stage_layers",
]
