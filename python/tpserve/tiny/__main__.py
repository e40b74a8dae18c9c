import sys

from tpserve.tiny.cli import main

sys.exit(main())
