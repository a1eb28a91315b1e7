from supervisor.cli import main

raise SystemExit(main())
