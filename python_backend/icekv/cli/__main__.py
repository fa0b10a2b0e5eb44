import sys

from icekv.cli import main

sys.exit(main())
