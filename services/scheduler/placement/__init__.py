"""Which node each catalogue model runs on (Prism §6.2): Algorithm 1 by KV pressure
(``algorithm.py``), the loop that moves models where it says (``loop.py``, each move a
``migration.py``), the request rates it weighs them by (``rates.py``), and which node
activates a model by its expected load time (``affinity.py``, Tangram Algorithm 2, over the
queue of waiting activations: ``activations.py``)."""

from services.scheduler.placement.activations import ActivationQueue
from services.scheduler.placement.affinity import Estimate, affinity_schedule, best_node
from services.scheduler.placement.algorithm import ModelDemand, kvpr, max_kvpr, place_models
from services.scheduler.placement.loop import PlacementLoop
from services.scheduler.placement.migration import Migration, MigrationSettings, Migrator
from services.scheduler.placement.rates import ModelRates

__all__ = ["ActivationQueue", "Estimate", "Migration", "MigrationSettings", "Migrator",
           "ModelDemand", "ModelRates", "PlacementLoop", "affinity_schedule", "best_node",
           "kvpr", "max_kvpr", "place_models"]
