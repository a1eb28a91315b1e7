from supervisor.devtools.standin import main

raise SystemExit(main())
