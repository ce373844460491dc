"""The CPU engine's control plane refuses what it must: oversized bodies, paths outside its weight roots,
weight-update groups dialling outside the weight peers, a non-loopback address without a key (the app and
the argument checks, without loading a model)."""

import asyncio
import json

import pytest
import requests
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from rlsys.rollout import protocol
from rlsys.rollout.client import EngineClient, EngineError
from rlsys.rollout.cpu import server
from rlsys.rollout.cpu.weights import decode_tensor_payload
from rlsys.sync.buckets import Bucket, Bucketer
from rlsys.sync.colocated import TensorTransport, serialize_flattened_bucket


class StubEngine:
    """Answers every route with its name; update_weights_from_disk is the real method's root check."""

    def __init__(self, roots, peers=""):
        self.weight_roots = roots
        self.weight_peers = server.parse_peers(peers)
        self.groups = {}

    def __getattr__(self, name):
        return lambda body: server._json({"route": name, "keys": sorted(body)})

    update_weights_from_disk = server.CPUEngine.update_weights_from_disk
    init_weights_update_group = server.CPUEngine.init_weights_update_group


def call(make_app, path, data=b"{}", headers=None):
    """POST to a fresh app (an aiohttp app belongs to the event loop it first ran on)."""

    async def go():
        async with TestClient(TestServer(make_app())) as client:
            r = await client.post(path, data=data, headers=headers or {"Content-Type": "application/json"})
            return r.status, await r.text()

    return asyncio.run(go())


def test_bodies_over_the_cap_are_refused():
    def app():
        return server.build_app(StubEngine([]), max_request_bytes=1000)

    status, _ = call(app, "/generate", b'{"text": "' + b"x" * 2000 + b'"}')
    assert status == 413
    assert call(app, "/generate", b'{"text": "hi"}')[0] == 200


class BucketReader(StubEngine):
    """Reads the bucket it is sent as the engine does (``decode_tensor_payload``) and says what arrived."""

    def update_weights_from_tensor(self, body):
        named = decode_tensor_payload(body["serialized_named_tensors"][0], body["load_format"])
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return server._result(True, "read", names=[n for n, _ in named], nbytes=nbytes)


def largest_sync_bucket(model: torch.nn.Module, bucket_mb: float) -> Bucket:
    """The largest bucket a sync packs of ``model``'s weights, in fp32 (the CPU engine's dtype): the
    ``Bucketer`` of ``DistributedWeightSync._export`` (its ramp only shrinks the first buckets)."""
    bucketer, buckets = Bucketer(int(bucket_mb * 2**20)), []
    for name, tensor in model.state_dict().items():
        if (full := bucketer.add(name, tensor.float())) is not None:
            buckets.append(full)
    buckets.append(bucketer.flush())
    return max(filter(None, buckets), key=lambda b: b.nbytes)


def sync_payload(bucket: Bucket) -> str:
    """The colocated payload of ``DistributedWeightSync._broadcast_bucket`` (the bytes inline, on CPU)."""
    bucket = bucket.aligned()
    return serialize_flattened_bucket(Bucket(bucket.names, bucket.tensors, bucket.nbytes))


def send_as_the_sync(app: web.Application, payload: str, version: str = "1"):
    """POST ``payload`` to ``app`` through the sync's own call (``TensorTransport.update``: EngineClient, JSON over
    HTTP); the engine's reply, or the ``EngineError`` the sync would raise."""
    transport = TensorTransport([], calls=None, timeout_s=120.0)

    async def go():
        async with TestServer(app) as test_server:
            client = EngineClient(str(test_server.make_url("")))
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    None, transport.update, client, [payload], version
                )
            except EngineError as e:
                return e
            finally:
                client.close()

    return asyncio.run(go())


def no_init(module, *args, **kwargs):
    return torch.nn.utils.skip_init(module, *args, **kwargs)  # the bytes are what counts, not their values


# Engine-side cap (request_cap) against the largest body the sync really sends at that bucket size. The cap holds
# 64 MiB of room for the JSON around a bucket, so a bucket that only fits because of the base64 growth (4/3) or
# because a tensor larger than the bucket goes alone must be big enough that the room cannot hide the difference.
@pytest.mark.parametrize(
    "bucket_mb,layers",
    [
        # eight 256 KiB tensors: two buckets of exactly 1 MiB, the fullest a bucket gets
        pytest.param(1, lambda: [no_init(torch.nn.Linear, 256, 256, bias=False) for _ in range(8)], id="full-bucket"),
        # a 61 MiB embedding goes alone, 61x the bucket; its base64 (81 MiB) is beyond the 1 MiB bucket's
        # 65.3 MiB of body: only the tensor's own size in the cap lets it in
        pytest.param(
            1,
            lambda: [no_init(torch.nn.Embedding, 250_000, 64), no_init(torch.nn.Linear, 64, 64)],
            id="tensor-over-the-bucket",
            marks=pytest.mark.slow,  # ~10 s on 2 busy cores
        ),
        # a full 200 MiB bucket: its base64 (267 MiB) exceeds the bucket plus the 64 MiB of room (264 MiB)
        pytest.param(
            200,
            lambda: [no_init(torch.nn.Linear, 3200, 4096, bias=False) for _ in range(4)],
            id="full-bucket-beyond-the-json-room",
            marks=pytest.mark.slow,  # ~26 s and 2 GiB on 2 busy cores
        ),
    ],
)
def test_the_largest_bucket_the_sync_sends_is_accepted(bucket_mb, layers):
    model = torch.nn.Sequential(*layers())
    bucket = largest_sync_bucket(model, bucket_mb)
    full = bucket.nbytes == bucket_mb * 2**20 or (len(bucket.names) == 1 and bucket.nbytes > bucket_mb * 2**20)
    assert full, "the case must be the largest bucket a sync makes at this size"
    app = server.build_app(BucketReader([]), max_request_bytes=server.request_cap(model, bucket_mb))
    reply = send_as_the_sync(app, sync_payload(bucket))
    assert not isinstance(reply, Exception), reply
    assert reply["names"] == bucket.aligned().names and reply["nbytes"] == bucket.nbytes


def test_one_kib_over_the_cap_is_refused_with_a_clear_error():
    """A body of exactly the cap is taken; 1 KiB more is refused (413) as soon as it passes the cap, unparsed,
    and the sync's error says why. Both are the largest 1 MiB bucket, its weight version padded to the size."""
    model = torch.nn.Sequential(*[no_init(torch.nn.Linear, 256, 256, bias=False) for _ in range(8)])
    cap = server.request_cap(model, 1)
    payload = sync_payload(largest_sync_bucket(model, 1))
    body = protocol.update_weights_from_tensor_payload([payload], "flattened_bucket", False, False, "")
    empty = len(requests.Request("POST", "http://engine/", json=body).prepare().body)  # as EngineClient sends it

    def app():
        return server.build_app(BucketReader([]), max_request_bytes=cap)

    at_cap = send_as_the_sync(app(), payload, version="v" * (cap - empty))
    assert not isinstance(at_cap, Exception), at_cap
    refused = send_as_the_sync(app(), payload, version="v" * (cap + 1024 - empty))
    assert isinstance(refused, EngineError) and refused.status == 413, refused
    assert f"HTTP 413: Maximum request body size {cap} exceeded" in str(refused)


def test_weights_from_disk_stay_inside_the_roots(tmp_path):
    inside = tmp_path / "ckpts" / "step_1"
    inside.mkdir(parents=True)

    def app():
        return server.build_app(StubEngine([str(tmp_path / "ckpts")]))

    for path in ("/etc", str(tmp_path), str(tmp_path / "ckpts" / ".." / "elsewhere"), 7):
        status, text = call(app, "/update_weights_from_disk", json.dumps({"model_path": path}))
        assert status == 400 and "outside the weight roots" in text and "--weight-roots" in text, (path, text)


def test_api_key_guards_everything_but_health():
    def app():
        return server.build_app(StubEngine([]), api_key="k")

    assert call(app, "/generate")[0] == 401
    assert call(app, "/generate", headers={"Authorization": "Bearer k", "Content-Type": "application/json"})[0] == 200


def test_a_public_address_needs_a_key(capsys):
    with pytest.raises(SystemExit):
        server.main(["--model-path", "/nonexistent", "--host", "0.0.0.0"])
    assert "--api-key" in capsys.readouterr().err


def test_weight_update_groups_dial_only_weight_peers():
    """A client holding the key still cannot make the engine connect to (and send to) a host of its choice."""

    def app():
        return server.build_app(StubEngine([], peers="10.1.2.0/24,192.0.2.7"))

    for address in ("8.8.8.8", "10.1.3.1", "192.0.2.8", "no-such-host.invalid", ""):
        body = {"master_address": address, "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
        status, text = call(app, "/init_weights_update_group", json.dumps(body))
        assert status == 400 and "is not a weight peer" in text and "--weight-peers" in text, (address, text)


def test_peers_are_loopback_plus_what_is_given():
    peers = server.parse_peers("10.1.2.0/24,192.0.2.7,localhost")
    for ok in ("127.0.0.1", "127.5.5.5", "::1", "localhost", "10.1.2.200", "192.0.2.7"):
        assert server.peer_allowed(ok, peers), ok
    for bad in ("192.0.2.6", "10.1.3.0", "8.8.8.8", "", "no-such-host.invalid"):
        assert not server.peer_allowed(bad, peers), bad
    assert not server.peer_allowed("10.1.2.3", server.parse_peers(""))
