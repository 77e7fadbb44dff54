"""The chapters' exercises, one module per chapter (chNN_name.py, named as its solution).

Each chapter ends with an exercise: write the function the chapter is about, with the
signature and contract of rosecourse/solutions/chNN_name.py, and pass it to the
chapter's `check_name`. Each module here holds one exercise whole: how the check swaps
the learner's function in, the runs it compares with the oracle, the probes (small
inputs) and the known wrong answers with their diagnoses. What they share (the verdict,
the oracle model, the one `check`) is in common.py; the engine's exercises (11 to 14)
also share engine.py.
"""

# What other parts of the course (the builds, the runner) use of the checks' machinery.
from rosecourse.exercises.common import (
    BATCH_TEXTS,
    CheckResult,
    encoded,
    oracle_model,
    reference_tokens,
    same,
)

__all__ = ["BATCH_TEXTS", "CheckResult", "encoded", "oracle_model", "reference_tokens", "same"]
