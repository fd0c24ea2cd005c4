import sys

from hapo_megatron.analysis.cli import rollouts_main

sys.exit(rollouts_main())
