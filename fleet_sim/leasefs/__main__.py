from fleet_sim.leasefs.daemon import main

raise SystemExit(main())
