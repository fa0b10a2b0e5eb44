"""Build the TensorRT engines of icekv's decode step (or, with --ptx-only, the plugins' PTX).

The same command as ``icekv build``; see build_scripts/README.md.
"""

import sys

from icekv.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
