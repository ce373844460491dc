"""A weight transport from outside rlsys, for ``test_modes.py``: ``rollout.sync.transport:
folder_transport:FolderTransport`` and ``rlsys.config.transports`` builds it on trainer rank 0.

Each bucket is written as a safetensors file into a folder beside the engine's model (the CPU engine reads
checkpoints under its model's parent directory) and loaded there with ``update_weights_from_disk``: a transport for
engines that share a file system with trainer rank 0."""

import contextlib
import os
import shutil
import tempfile

from safetensors.torch import save_file


class FolderTransport:
    buckets_sent = 0  # what the test reads: the ranks run in its process

    def __init__(self, engines, *, calls, timeout_s):
        self.engines, self.calls, self.timeout_s = engines, calls, timeout_s
        self.folders: list[str] = []
        self.parents = None

    def connect(self):
        self.parents = None  # a restarted engine may serve another model folder

    def prepare(self, version):
        if self.parents is None:  # the model each engine started from (a disk update changes its model_path)
            infos = [engine.model_info(timeout_s=self.timeout_s) for engine, _tp in self.engines]
            self.parents = [os.path.dirname(os.path.realpath(info["model_path"])) for info in infos]
        self.folders = [tempfile.mkdtemp(prefix=f"sync-v{version}-", dir=parent) for parent in self.parents]
        self.count = 0

    def send(self, bucket, version):
        self.count += 1
        # the bucket's tensors may be views into one buffer, which safetensors refuses to save: copies
        tensors = {n: t.detach().clone() for n, t in zip(bucket.names, bucket.tensors)}
        replies = []
        for (engine, _tp), folder in zip(self.engines, self.folders):
            path = os.path.join(folder, f"bucket-{self.count}")
            os.makedirs(path)
            save_file(tensors, os.path.join(path, "model.safetensors"))
            replies.append(self.calls.submit(self._load, engine, path, version))
        FolderTransport.buckets_sent += 1
        return contextlib.nullcontext(replies)  # the files are theirs until removed

    def _load(self, engine, path, version):
        reply = engine.update_weights_from_disk(
            path, flush_cache=False, weight_version=str(version), timeout_s=self.timeout_s
        )
        shutil.rmtree(path)
        return reply

    def finish(self, version):
        self.abort()

    def abort(self):
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.folders = []
