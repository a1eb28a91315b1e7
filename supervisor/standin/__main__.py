from supervisor.standin import main

raise SystemExit(main())
