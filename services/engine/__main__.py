import os
import sys

# An engine sharing its node with other engines (a device ledger, or a standby one)
# must not keep its OpenMP threads spinning between steps: the cores are shared, and idle
# engines' spinning slowed a busy one's burst 5-8x on 2 cores. OpenMP reads this when torch
# loads it, so before any import of the engine. (A lone engine keeps the default: spinning
# halves its one-row decode steps.)
if any(a.split("=")[0] in ("--device-ledger", "--standby", "--pool") for a in sys.argv[1:]) or \
        any(os.environ.get(f"OVERTURE_ENGINE__{k}") for k in ("DEVICE_LEDGER", "STANDBY", "POOL")):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from services.engine.main import main

raise SystemExit(main())
