"""Ray Serve peer: the reference MLP behind ``@serve.batch``, Open Inference Protocol JSON in/out.

Run by bench/peer_servers.py inside its own venv: ``python ray_app.py PORT MAX_BATCH WAIT_S THREADS``.
The model is batchpilot's ``builtin:mlp`` (same seed, same weights).
"""

from __future__ import annotations

import signal
import sys
import threading

import numpy as np
import orjson
import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from batchpilot_runtime.models import build_builtin

PORT, MAX_BATCH, WAIT_S, THREADS = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])


@serve.deployment(max_ongoing_requests=max(4 * MAX_BATCH, 64), ray_actor_options={"num_cpus": 1})
class MLP:
    def __init__(self) -> None:
        torch.set_num_threads(THREADS)
        self.model = build_builtin("mlp").eval()

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=WAIT_S)
    async def run(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        sizes = [x.shape[0] for x in xs]
        with torch.inference_mode():
            y = self.model(torch.from_numpy(np.concatenate(xs))).numpy()
        return list(np.split(y, np.cumsum(sizes)[:-1]))

    async def __call__(self, request: Request) -> Response:
        doc = orjson.loads(await request.body())
        t = doc["inputs"][0]
        x = np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
        y = await self.run(x)
        out = {
            "model_name": "m",
            "outputs": [{"name": "output", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel()}],
        }
        return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(MLP.bind(), route_prefix="/v2/models/m/infer", name="mlp")
    print("READY", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
