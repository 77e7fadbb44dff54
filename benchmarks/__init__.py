"""rose's benchmark programs: run from a clone of the repository, `python -m benchmarks.NAME`.

They sit beside the packages, not in them: `pip install .` installs none of them, and
nothing in `rosetrainer/` or `roseinfer/` imports them (tests/project/test_layout.py). A benchmark
may import the packages and the course; docs/benchmarks.md lists them and what they print.
"""
