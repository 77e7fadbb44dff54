"""`python -m roseinfer.cli_generate`: the project's named command for generation.

The command itself lives in roseinfer/cli/generate.py beside the other front doors;
this module keeps its well-known name.
"""

import sys

from roseinfer.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
