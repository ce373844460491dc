import sys

from rlsys.convert.cli import main

sys.exit(main())
