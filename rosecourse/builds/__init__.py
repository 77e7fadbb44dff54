"""Builds: rose's main pieces, written whole by the learner and graded against rose.

One module per build (its contract's grader: parts, probe, known wrong answers); the
reference solutions are rosecourse/solutions/build_*.py, whose docstrings are the
learner's stubs. `rose-course check <build>` grades a workspace's file part by part.
"""
