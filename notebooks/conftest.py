"""The SLURM tutorial runs where a SLURM cluster is up (CI starts one with
``.ci/slurm``); elsewhere nbval leaves it out, unless
``NBLAUNCH_REQUIRE_SLURM`` is set, when its absence is an error."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import slurm_cluster  # noqa: E402

collect_ignore = ["07_slurm.ipynb"] if slurm_cluster.why_not() else []
