from k26dev.standin import main

raise SystemExit(main())
