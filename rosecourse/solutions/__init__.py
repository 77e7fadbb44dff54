"""Reference solutions to the chapters' exercises, one module per chapter (chNN_name.py).

Try the exercise first: `rose-course start DIR` writes each module as a stub (its
signature and contract docstring, no answer) and `rose-course check NN --dir DIR`
grades yours. Each module's function docstring is the contract the stub shows. A
chapter's exercise cell runs the same check on the solution here, so CI runs every
check on a right answer. Nothing in roseinfer imports these modules.
"""
