"""The chapters' exercises, one folder per chapter (chNN_name/, named as the learner's file).

Each chapter ends with an exercise: write the function the chapter is about, with the
signature and contract of its folder's reference.py, and pass it to the chapter's
`check_name`. Each folder holds one exercise whole: the reference and its hints
(reference.py, from which the learner's stub is cut), the check (__init__.py: how it
swaps the learner's function in, the runs it compares with the oracle, the probes), and
its known answers (mistakes.py, data): the known mistakes the check names, with their
diagnoses, and the answers the check is proven against. What the checks share (the verdict, the oracle model, the
one `check`) is in common.py, the contract's general clauses in contract.py; the
engine's exercises (11 to 14) also share engine.py.
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
