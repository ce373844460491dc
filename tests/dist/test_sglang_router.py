"""Router mode against the real sgl-router: two of rlsys's CPU engines behind ``python -m sglang_router.launch_router``.

tests/dist/test_servers.py drives the pool's router mode with a fake router that answers by itself. Here the real
router (sglang_router's Rust router, from the SGLang contract environment that tests/contract/setup_sglang_contract.sh
builds) stands between rlsys and two CPU engines, all launched as rlsys launches them (``cpu_engine_command``,
``sglang_router``, ``EnginePool.launch``, with an API key), and the test checks that:
- the router registers both engines and a rollout through it reaches both of them; every sample is the one the engine
  gives when asked directly (the router passes ``sampling_seed``, ``n`` and the prompts through unchanged);
- a weight sync as rlsys does it (pause, flush, update in a session, continue: to each engine directly, never to the
  router) holds the rollouts sent meanwhile through the router until the engines continue, then serves them and every
  later one from the new weights, on both engines;
- a second router runs next to the first (rlsys gives each its own Prometheus port, not sgl-router's 0.0.0.0:29000);
- what the router forwards of rlsys's /generate body (an echo worker behind it): the prompts, every sampling key a
  rollout sends, the API key; not ``return_routed_experts``, which is why ``start_engines`` launches no router for R3;
- the router counts as healthy once it can route (``/readiness``; its ``/health`` answers before it registered a
  worker, and a generate then gets 503), and rlsys's probe for it fails where the launcher cannot start.

Which engine served a sample shows in its ``meta_info.weight_version``: each engine gets a version of its own.

The router runs from a folder of its own that tests/contract/setup_sglang_contract.sh installs: sglang-router 0.3.2
with what its launcher imports (setproctitle, fastapi, uvicorn, aiohttp, orjson), without sglang (whose presence makes
the launcher's optional tracing import load sglang and torch, ~8 s). Skips, quoting why, where that folder is missing
or the router's Rust extension does not import.
"""

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlsys.local_ranks import free_port
from rlsys.rollout import cpu_launch, protocol, sglang_launch
from rlsys.rollout.client import EngineClient
from rlsys.rollout.pool import EnginePool
from rlsys.rollout.process import ServerProcess

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
CONTRACT_DIR = Path(os.environ.get("RLSYS_SGLANG_CONTRACT_DIR", REPO / ".sglang_contract"))
KEY = "router-test-key"
VOCAB = 1001  # tests/tiny_models.py


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def router_folders(tmp_path_factory) -> SimpleNamespace:
    """``env``: what ``sglang_router(..., python=sys.executable, env=...)`` needs to start the real router (its own
    folder, which tests/contract/setup_sglang_contract.sh installs with what its launcher imports); ``bare``: a
    folder with ``sglang_router`` alone, which imports but whose launcher cannot start."""
    router = CONTRACT_DIR / "router_env"
    if not (router / "sglang_router").is_dir():
        failed = CONTRACT_DIR / "FAILED"
        why = failed.read_text().strip() if failed.is_file() else "tests/contract/setup_sglang_contract.sh builds it"
        pytest.skip(f"sgl-router is not installed in {router} ({why})")
    env = {"PYTHONPATH": str(router)}
    rust = _python("import sglang_router.router", {**os.environ, **env})
    if rust.returncode != 0:
        pytest.skip(f"sglang_router does not import from {router}: {rust.stderr.strip().splitlines()[-1]}")
    bare = tmp_path_factory.mktemp("sgl_router_bare")
    (bare / "sglang_router").symlink_to(router / "sglang_router")
    return SimpleNamespace(env=env, bare={"PYTHONPATH": str(bare)})


@pytest.fixture(scope="module")
def router_env(router_folders) -> dict:
    return router_folders.env


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The engines' launch checkpoint and the "trained" one they get in the weight sync (one folder: the engines'
    default --weight-roots is the model's parent)."""
    from tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("router_ckpts")
    return {name: make_tiny_hf_checkpoint("qwen2", str(root / name), seed=s) for s, name in enumerate(("old", "new"))}


def _engine(model_dir: str, index: int, log_dir: Path) -> ServerProcess:
    port = free_port()
    command = cpu_launch.cpu_engine_command(model_dir, index, "127.0.0.1", port, KEY)
    command += ["--weight-version", f"0.e{index}"]  # who served a sample, until the sync sets 1.e{index}
    return ServerProcess(command, f"http://127.0.0.1:{port}", log_file=str(log_dir / f"engine{index}.log"))


def _direct(client: EngineClient, prompts, sampling) -> list:
    """Each prompt asked of one engine alone, as the pool numbers it (prompt i's samples seeded from seed + i * n)."""
    seed, n = sampling.get("sampling_seed"), sampling["n"]
    return [
        s
        for i, p in enumerate(prompts)
        for s in client.generate([p], sampling if seed is None else dict(sampling, sampling_seed=seed + i * n))
    ]


def test_router_probe_asks_for_what_the_launcher_imports(router_folders):
    """``start_engines`` launches a router only where the probe passes: one that cannot start would fail the run."""
    assert sglang_launch.sglang_router_available(sys.executable, env=router_folders.env)
    # here `import sglang_router` passes, and `python -m sglang_router.launch_router` fails: No module named ...
    assert not sglang_launch.sglang_router_available(sys.executable, env=router_folders.bare)


@pytest.mark.slow  # two engines and a router: 15-35 s on 2 busy cores
def test_real_router_spreads_rollouts_and_serves_the_synced_weights(router_env, checkpoints, tmp_path):
    t0 = time.monotonic()
    engines = [_engine(checkpoints["old"], i, tmp_path) for i in range(2)]
    router = sglang_launch.sglang_router(
        [e.url for e in engines],
        python=sys.executable,
        env=router_env,
        log_file=str(tmp_path / "router.log"),
        api_key=KEY,
    )
    pool = EnginePool.launch(engines, router=router, timeout_s=60, health_timeout_s=120, api_key=KEY)
    second = None
    try:
        assert pool.router_client is not None and pool.router_client.url == router.url
        started = time.monotonic() - t0
        prompts = [[(37 * i) % (VOCAB - 1) + 1, 11, 13, (5 * i) % (VOCAB - 1) + 1] for i in range(12)]
        sampled = protocol.sampling_params(temperature=1.0, max_new_tokens=8, n=2, sampling_seed=1234)
        greedy = protocol.sampling_params(temperature=0.0, max_new_tokens=8)

        # 1. A rollout through the router reaches both engines, and every sample is the engine's own.
        routed = pool.generate(prompts, sampled)
        assert [s.prompt_index for s in routed] == [i for i in range(len(prompts)) for _ in range(2)]
        served = Counter(s.weight_version for s in routed)
        assert set(served) == {"0.e0", "0.e1"}, f"the router used {dict(served)}"
        direct = _direct(pool.clients[0], prompts, sampled)
        assert [s.output_ids for s in routed] == [s.output_ids for s in direct]
        for r, d in zip(routed, direct):
            assert r.logprobs == pytest.approx(d.logprobs, abs=1e-5)
        before = [s.output_ids for s in pool.generate(prompts, greedy)]

        # 2. The weight sync, rlsys's way: every call to the engines themselves; rollouts sent meanwhile wait.
        for c in pool.clients:
            c.pause_generation("abort")
        for c in pool.clients:
            c.flush_cache(wait_s=30)
        with ThreadPoolExecutor(1) as background:
            held = background.submit(pool.generate, prompts, greedy)
            time.sleep(1.0)
            assert not held.done(), f"{len(held.result())} samples came from paused engines"
            for i, c in enumerate(pool.clients):
                with c.weight_update_session():
                    c.update_weights_from_disk(checkpoints["new"], weight_version=f"1.e{i}")
            assert not held.done()
            for c in pool.clients:
                c.continue_generation()
            after = held.result(timeout=60)
        assert {s.weight_version for s in after} <= {"1.e0", "1.e1"}
        new_greedy = _direct(pool.clients[1], prompts, greedy)
        assert [s.output_ids for s in after] == [s.output_ids for s in new_greedy] != before

        # ... and both engines still serve the router's rollouts, from the new weights.
        routed = pool.generate(prompts, sampled)
        assert set(Counter(s.weight_version for s in routed)) == {"1.e0", "1.e1"}
        assert [s.output_ids for s in routed] == [s.output_ids for s in _direct(pool.clients[0], prompts, sampled)]

        # 3. A second router next to the first (another run's on this node): each has its own metrics port.
        log = str(tmp_path / "router2.log")
        second = sglang_launch.sglang_router(
            [e.url for e in engines], python=sys.executable, env=router_env, log_file=log, api_key=KEY
        )
        second.start()
        second.wait_healthy(60)
        client = EngineClient(second.url, 60, api_key=KEY)
        try:
            assert client.generate([prompts[0]], greedy)[0].output_ids == after[0].output_ids
        finally:
            client.close()
        print(f"engines and router up in {started:.1f} s, test {time.monotonic() - t0:.1f} s")
    finally:
        if second is not None:
            second.stop()
        pool.close()
    assert not router.alive() and not any(e.alive() for e in engines)


class _EchoWorker(BaseHTTPRequestHandler):
    """An SGLang-shaped worker that keeps each /generate body and Authorization header it gets (``received``). Its
    model info takes ``info_delay_s``: the router registers it that much later than it starts listening."""

    received: list = []
    info_delay_s = 1.5

    def log_message(self, *args):
        pass

    def _reply(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in (protocol.SERVER_INFO, "/get_server_info"):
            self._reply({"version": "0.5.23"})
        elif self.path in (protocol.MODEL_INFO, "/get_model_info"):
            time.sleep(self.info_delay_s)
            self._reply({"model_path": "echo", "weight_version": "echo"})
        else:
            self._reply(None)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append((body, self.headers.get("Authorization")))
        n = body["sampling_params"]["n"]
        outs = [
            {
                "text": "x",
                "output_ids": [p[0], j],
                "meta_info": {
                    "id": f"{i}-{j}",
                    "finish_reason": {"type": "length", "length": 2},
                    "prompt_tokens": len(p),
                    "completion_tokens": 2,
                    "weight_version": "echo",
                    "output_token_logprobs": [[-0.5, p[0], None], [-0.5, j, None]],
                },
            }
            for i, p in enumerate(body["input_ids"])
            for j in range(n)
        ]
        self._reply(outs)


def test_what_the_real_router_forwards_of_a_generate_request(router_env, tmp_path):
    _EchoWorker.received.clear()
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _EchoWorker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{worker.server_address[1]}"
    router = sglang_launch.sglang_router(
        [url], python=sys.executable, env=router_env, log_file=str(tmp_path / "router.log"), api_key=KEY
    )
    client = EngineClient(router.url, 60, api_key=KEY)
    try:
        router.start()
        router.wait_healthy(60)  # /readiness: the worker is registered (/health: the router listens, 503s follow)
        # every sampling key a rollout sends (protocol.sampling_params_from_config), and R3's request for the routes
        sampling = protocol.sampling_params(
            temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, stop=["</answer>"], stop_token_ids=[2], n=2
        )
        sampling.update(min_new_tokens=3, sampling_seed=77)
        outs = client.generate([[5, 6, 7]], sampling, return_routed_experts=True)
        assert [(s.prompt_index, s.output_ids) for s in outs] == [(0, [5, 0]), (0, [5, 1])]
        ((body, auth),) = _EchoWorker.received
        assert auth == f"Bearer {KEY}"
        assert body["input_ids"] == [[5, 6, 7]] and body["sampling_params"] == sampling
        assert body["return_logprob"] is True and body["stream"] is False
        # sgl-router 0.3.2 re-serializes the body into its own GenerateRequest, which has no such field: an R3 rollout
        # through it would get no routes, so start_engines launches no router for R3 (lift that once this fails)
        assert "return_routed_experts" not in body
    finally:
        client.close()
        router.stop()
        worker.shutdown()
