from hybridrec.cli.main import main

raise SystemExit(main())
