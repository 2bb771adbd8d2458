from tspbench.cli import main

raise SystemExit(main())
