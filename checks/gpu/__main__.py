import sys

from checks.gpu.run import main

sys.exit(main())
