from steptune.cli import main

raise SystemExit(main())
