import sys

from splitlab.cli import main

sys.exit(main())
