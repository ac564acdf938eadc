# latentd_client: Python client of latentd.v1.DecodeService (MLA decode attention over
# gRPC), for serving stacks that keep their KV caches on a latentd daemon.
from .client import (  # noqa: F401
    LatentdClient,
    DecodeSession,
    StepOutput,
    LatentdError,
    ROUTE_HEADER,
    to_wire,
    from_wire,
    reference_decode,
    fp8_kv_roundtrip,
    page_keys,
    PAGE_TOKENS,
)
from .ring import DoorbellRing, STEP_DTYPE, COMPLETION_DTYPE, ring_bytes  # noqa: F401
from .sharded import (  # noqa: F401
    ShardedClient,
    HashRing,
    route_hash,
    salted_route,
    missing_result_code,
)
from . import latentd_pb2, latentd_pb2_grpc  # noqa: F401
