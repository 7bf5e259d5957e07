from scalelab.cli.main import main

raise SystemExit(main())
