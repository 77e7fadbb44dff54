"""Builds: rose's main pieces, written whole by the learner and graded against rose.

One folder per build: its check in `__init__.py` (the parts and the probe) and its known
wrong answers, as data, in `mistakes.py`. The reference solutions are
rosecourse/solutions/build_*.py, whose docstrings are the learner's stubs.
`rose-course check <build>` grades a workspace's file part by part.
"""
