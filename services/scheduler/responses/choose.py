"""Which archive the scheduler's stored responses go to, from its config: the shared S3
bucket when one is configured (every replica sees it), else the state folder on local
disk, else none (memory only, as before)."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.config import SchedulerConfig
from services.scheduler.responses.archive import DiskArchive, NullArchive, ResponseArchive
from services.scheduler.responses.s3_archive import S3Archive


def response_archive(config: SchedulerConfig) -> ResponseArchive:
    if config.s3.bucket:
        return S3Archive(config.s3)
    if config.state_dir:
        return DiskArchive(Path(config.state_dir) / "responses")
    return NullArchive()
