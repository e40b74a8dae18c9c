import sys

from tpserve.tiny import main

sys.exit(main())
