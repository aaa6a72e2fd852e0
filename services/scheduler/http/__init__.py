"""The public HTTP API (aiohttp): the app and its typed state (``app.py``, ``state.py``),
the OpenAI routes (``completions.py``, ``responses.py``, ``models.py``), advisories
(``advisory.py``), operators' routes (``admin.py``), health and metrics (``health.py``),
the keyless documents (``pages.py``), the hardened server that runs it (``server.py``),
and the bytes of bodies each tenant may have being read (``body_budget.py``)."""

from services.scheduler.http.app import build_app
from services.scheduler.http.body_budget import BodyBudget
from services.scheduler.http.server import HardenedRunner
from services.scheduler.http.state import STATE, ApiState

__all__ = ["STATE", "ApiState", "BodyBudget", "HardenedRunner", "build_app"]
