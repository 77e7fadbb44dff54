"""Builds: rose's main pieces, written whole by the learner and graded against rose.

One folder per build: its check in `__init__.py` (the parts and the probe), its reference
solution in `reference.py` (whose docstrings are the learner's stub; where a piece is
rose's own, it delegates to rose), and its known wrong answers, as data, in `mistakes.py`.
`rose-course check <build>` grades a workspace's file part by part.
"""
