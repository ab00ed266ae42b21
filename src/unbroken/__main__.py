from unbroken.cli.main import main

raise SystemExit(main())
