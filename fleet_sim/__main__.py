"""``python -m fleet_sim``: the same command line as ``fleet-sim``."""

from fleet_sim.cli import main

raise SystemExit(main())
