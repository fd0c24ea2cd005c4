import sys

from hapo_megatron.analysis.cli import main

sys.exit(main())
