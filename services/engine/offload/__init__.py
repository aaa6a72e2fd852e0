"""KV kept off the device, behind one boundary the engine core calls (``Offload``).

Worker thread (the core's side):
    boundary          ``Offload``, the points the core calls, and ``NullOffload`` (device
                      only, recompute) beside it; ``OffloadFactory``, how the core gets one
    kvstore_offload   ``KVStoreOffload``: the node's kvstore behind the boundary, routing to
    loads             a request's stored prefix loaded layer by layer; failed ones returned
                      to the core to requeue
    saves             computed blocks saved, pinned until the kvstore answers
    device_prefetch/  advised sessions' KV copied into free device blocks

Event loop:
    kvstore_link      the kvstore for the served model: builds the worker side with the
                      core, starts the client, finds advised sessions
    kvstore_client    the async gRPC client (``kvstore_wire`` its protos)
    reuse_planner     ``ReusePlanner``: what of a prompt to load (``cost_model`` decides)
    prefetch_joins    device prefetch loads under way, awaited by requests of their prefix

Between them: ``transport`` (the worker's calls posted to the loop, the kvstore's answers
back as commands for the worker), ``jobs`` (the data of a load and a save), ``save_log``
(the saves that landed, for the scheduler). The plain data every sequence carries
(``ReusePlan``, ``OffloadState``, ``LayerReadiness``) is the core's, beside ``sequence.py``.
"""

from services.engine.offload.boundary import LayerWait, NullOffload, Offload, OffloadFactory
from services.engine.offload.cost_model import LAYERWISE, RECOMPUTE, WHOLE_PREFIX
from services.engine.offload.device_prefetch import DevicePrefetch, PrefetchOrder
from services.engine.offload.jobs import LoadJob, PoolGeometry, SaveJob
from services.engine.offload.kvstore_client import KVStoreClient
from services.engine.offload.kvstore_link import KVStoreLink
from services.engine.offload.kvstore_offload import KVStoreOffload, offload_for
from services.engine.offload.prefetch_joins import PrefetchJoins
from services.engine.offload.reuse_planner import ReusePlanner
from services.engine.offload.save_log import SavedSession, SaveLog
from services.engine.offload.transport import KVStoreAnswers, KVTransport, LoopTransport

__all__ = [
    "LAYERWISE",
    "RECOMPUTE",
    "WHOLE_PREFIX",
    "DevicePrefetch",
    "KVStoreAnswers",
    "KVStoreClient",
    "KVStoreLink",
    "KVStoreOffload",
    "KVTransport",
    "LayerWait",
    "LoadJob",
    "LoopTransport",
    "NullOffload",
    "Offload",
    "OffloadFactory",
    "PoolGeometry",
    "PrefetchJoins",
    "PrefetchOrder",
    "ReusePlanner",
    "SaveJob",
    "SaveLog",
    "SavedSession",
    "offload_for",
]
