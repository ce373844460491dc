"""The CPU engine's control plane refuses what it must: oversized bodies, paths outside its weight roots,
weight-update groups dialling outside the weight peers, a non-loopback address without a key (the app and
the argument checks, without loading a model)."""

import asyncio
import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from rlsys.rollout.cpu import server


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


def test_the_cap_fits_the_largest_bucket_or_tensor():
    model = torch.nn.Embedding(1000, 64)  # 256 KB in fp32
    assert server.request_cap(model, 1) == int((1 << 20) * 4 / 3) + (64 << 20)
    big = torch.nn.Embedding(100_000, 64)  # 25.6 MB in fp32, over a 1 MiB bucket
    assert server.request_cap(big, 1) == int(100_000 * 64 * 4 * 4 / 3) + (64 << 20)


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
