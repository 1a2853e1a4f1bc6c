import sys

from fusionllm.testbed.cli import main

sys.exit(main())
