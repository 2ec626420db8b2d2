from bubblesnap.run.launcher import main

raise SystemExit(main())
