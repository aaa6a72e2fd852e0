"""``python -m services.nodemgr``: start one node's manager."""

from services.nodemgr.main import main

raise SystemExit(main())
