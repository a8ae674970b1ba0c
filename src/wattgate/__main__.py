import sys

from wattgate.cli import main

sys.exit(main())
