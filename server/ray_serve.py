"""tinyserve as a Ray Serve application: replicas that each hold the whole FastAPI app.

    tinyserve serve-ray --min-replicas 1 --max-replicas 4 --num-cpus 2   (starts or joins Ray: RAY_ADDRESS)
    serve run deploy/ray/serve_config.yaml                               (Ray's own CLI; `serve deploy` on a cluster)

Each replica is a Ray actor running `create_app` (registry, continuous-batching engines, every route)
behind Serve's HTTP proxy, so both wire formats, SSE streams and the demo page work unchanged. Serve
routes requests, autoscales on ongoing requests per replica, health-checks replicas (a replica is
healthy once its models are loaded) and lets in-flight requests finish on shutdown. The server's own
settings come from `TINYSERVE_*` variables of the process that builds the application, or `settings`.
"""

from __future__ import annotations

import math
import sys

from pydantic import BaseModel, Field
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import Settings

REPLICA_HEADER = b"x-tinyserve-replica"


class RayServeOptions(BaseModel):
    min_replicas: int = Field(1, ge=0, description="replicas kept running (0: scale to zero when idle)")
    max_replicas: int = Field(2, ge=1, description="replicas the autoscaler may start")
    target_ongoing_requests: float = Field(16, gt=0, description="autoscaling target: ongoing requests per replica")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica; torch computes on floor(num_cpus) threads (>= 1)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (the registry then loads on CUDA, half precision)")
    max_queued_requests: int = Field(64, ge=-1, description="requests waiting in Serve for a replica before 429")
    host: str = Field("127.0.0.1", description="interface of Serve's HTTP proxy (tinyserve serve-ray only)")
    port: int = Field(8000, ge=1, le=65535, description="port of Serve's HTTP proxy (tinyserve serve-ray only)")
    settings: dict = Field({}, description="server Settings fields, over the TINYSERVE_* environment")


def torch_threads(num_cpus: float) -> int:
    """One OpenMP thread per reserved core: replicas sharing a node never oversubscribe it."""
    return max(1, math.floor(num_cpus))


class ReplicaHeader:
    """Names the replica that answered (x-tinyserve-replica: its Ray actor name, in namespace "serve")."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.replica: bytes | None = None  # known once the app runs inside its replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.replica is None:
            self.replica = serve.get_replica_context().replica_id.to_full_id_str().encode()
        replica = self.replica

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


def build_app(options: RayServeOptions, settings: Settings | None = None) -> serve.Application:
    """The Serve application; `settings` defaults to the environment's, updated by `options.settings`."""
    settings = settings or Settings(**options.settings)
    threads = torch_threads(options.num_cpus)

    def make_app():  # runs in each replica's process
        import torch

        from server.api.app import create_app

        torch.set_num_threads(threads)
        app = create_app(settings)
        app.add_middleware(ReplicaHeader)
        return app

    @serve.deployment(
        name="tinyserve",
        ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": options.num_gpus},
        autoscaling_config={
            "min_replicas": options.min_replicas,
            "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests,
        },
        # a replica takes what its engines can hold (decoding + queued); beyond that Serve queues, then 429s
        max_ongoing_requests=settings.max_batch_size + settings.max_queue,
        max_queued_requests=options.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        graceful_shutdown_timeout_s=settings.shutdown_grace_s,  # streams get the server's own grace
        graceful_shutdown_wait_loop_s=1.0,
    )
    @serve.ingress(make_app)
    class TinyServe:
        def check_health(self) -> None:
            if not self.app.state.ready:
                raise RuntimeError("models not loaded yet")

    return TinyServe.bind()


def app_builder(args: dict) -> serve.Application:
    """Serve's application builder: `import_path: server.ray_serve:app_builder`, `args`: RayServeOptions."""
    return build_app(RayServeOptions(**args))


def main(argv: list[str] | None = None) -> None:
    import ray
    from pydantic_settings import CliApp, CliSettingsSource

    source = CliSettingsSource(RayServeOptions, cli_prog_name="tinyserve serve-ray", cli_kebab_case=True)
    options = CliApp.run(RayServeOptions, cli_args=sys.argv[1:] if argv is None else argv, cli_settings_source=source)
    ray.init()  # a local Ray instance, or the cluster at RAY_ADDRESS
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(options), name="tinyserve", route_prefix="/", blocking=True)


if __name__ == "__main__":
    main()
