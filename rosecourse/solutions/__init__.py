"""Reference solutions to the builds, one module per build (build_name.py).

Try the build first: `rose-course start DIR` writes each module as a stub (its classes and
functions with their contract docstrings, no answer) and `rose-course check NAME --dir DIR`
grades yours. A chapter exercise's reference lives in its own folder
(rosecourse/exercises/chNN_name/reference.py). Nothing in roseinfer imports these modules.
"""
