from elasticd.cli import main

raise SystemExit(main())
