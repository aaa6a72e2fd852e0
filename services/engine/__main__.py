from services.engine.main import main

raise SystemExit(main())
