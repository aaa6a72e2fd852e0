"""Which node each catalogue model runs on (Prism §6.2): Algorithm 1 by KV pressure
(``algorithm.py``), the loop that moves models where it says (``loop.py``), and the
request rates it weighs them by (``rates.py``)."""

from services.scheduler.placement.algorithm import ModelDemand, kvpr, max_kvpr, place_models
from services.scheduler.placement.loop import PlacementLoop
from services.scheduler.placement.rates import ModelRates

__all__ = ["ModelDemand", "ModelRates", "PlacementLoop", "kvpr", "max_kvpr", "place_models"]
