from forewarn.cli import main

raise SystemExit(main())
