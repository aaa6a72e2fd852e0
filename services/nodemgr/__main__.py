from services.nodemgr.main import main

raise SystemExit(main())
