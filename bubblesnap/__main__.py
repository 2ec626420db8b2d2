from bubblesnap.cli import main

raise SystemExit(main())
