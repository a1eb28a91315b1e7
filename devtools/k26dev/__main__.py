from k26dev.cli import main

raise SystemExit(main())
