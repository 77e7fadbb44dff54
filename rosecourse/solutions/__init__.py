"""Reference solutions to the chapters' exercises, one module per chapter.

Try the exercise first. A chapter's exercise cell imports its solution from here, so
the notebooks run every check (rosecourse/exercises.py) on a right answer; to do the
exercise, replace that import with your own function of the same name and signature,
and run the check cell. Nothing in roseinfer imports these modules.
"""
