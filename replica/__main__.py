from replica.cli import main

raise SystemExit(main())
