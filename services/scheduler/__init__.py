"""Scheduler: the public OpenAI-compatible API, node registry, placement policy, metrics."""

from services.scheduler.app import run
from services.scheduler.config import SchedulerConfig

__all__ = ["SchedulerConfig", "run"]
