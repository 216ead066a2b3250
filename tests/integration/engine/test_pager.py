"""The pager against a real S3 server (SeaweedFS): blobs put with BlobStore, fetched by digest into the disk tier."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from preft.common import metrics
from preft.common.errors import Unavailable
from preft.engine.paging.pager import Pager
from preft.registry.blobstore import BlobStore
from preft.stack import free_port
from tests.adapter_specs import CountingBlobs, RecordingHost, make_pager, upload


@pytest.fixture
def store(s3_bucket) -> BlobStore:
    return BlobStore(s3_bucket.settings())


@pytest.fixture
def specs(store, adapters):
    return {name: upload(store, path) for name, path in adapters["llama"].items()}


@pytest.fixture
def make(store, model_dirs, tmp_path):
    host = RecordingHost(model_dirs["llama"])
    counting = CountingBlobs(store)

    def factory(**kw) -> Pager:
        return make_pager(**{"host": host, "blobs": counting, "disk_dir": tmp_path / "disk", **kw})

    factory.host, factory.blobs = host, counting
    return factory


def _counter(metric, tier: str) -> float:
    return metric.labels(tier)._value.get()


def test_eight_concurrent_requests_download_once(make, specs):
    spec = specs["lora_a"]

    async def scenario():
        pager = make()
        await pager.start()
        make.blobs.gate.clear()
        s3_hits = _counter(metrics.PAGING_HITS, "s3")
        waiters = [asyncio.create_task(pager.ensure(spec)) for _ in range(8)]
        await asyncio.to_thread(make.blobs.started.wait, 10)
        await asyncio.sleep(0.1)  # let every waiter arrive while the download is held
        make.blobs.gate.set()
        paths = await asyncio.gather(*waiters)
        assert len(set(paths)) == 1 and (paths[0] / "adapter_model.safetensors").is_file()
        assert make.blobs.calls == {f.sha256: 1 for f in spec.files}
        assert make.host.adds == 1
        assert _counter(metrics.PAGING_HITS, "s3") == s3_hits + 1

    asyncio.run(scenario())


def test_corrupt_blob_fails_and_leaves_nothing_on_disk(make, specs, s3_bucket, tmp_path):
    spec = specs["direft_a"]
    weights = next(f for f in spec.files if f.path == "adapter_model.safetensors")
    # overwrite the blob behind BlobStore's back (a put through it would be refused)
    client = s3_bucket.client()
    client.put_object(Bucket=s3_bucket.bucket, Key=BlobStore.key(weights.sha256), Body=b"x" * weights.size_bytes)

    async def scenario():
        pager = make()
        await pager.start()
        for _ in range(2):  # failures are not remembered: the second request tries again, and fails again
            with pytest.raises(Unavailable, match="corrupt"):
                await pager.ensure(spec)
        assert make.blobs.calls[weights.sha256] == 2
        assert pager.resident("disk") == [] and make.host.loaded == set()
        disk = tmp_path / "disk"
        assert sorted(p.name for p in disk.iterdir()) == [".staging", ".trash"]
        assert list((disk / ".staging").iterdir()) == []

    asyncio.run(scenario())


def test_disk_tier_evicts_by_bytes(make, specs, tmp_path):
    names = ("lora_a", "lora_b", "lora_c")
    sizes = [sum(f.size_bytes for f in specs[n].files) for n in names]

    async def scenario():
        pager = make(host_max_adapters=1, disk_max_bytes=sum(sorted(sizes)[1:]) + 1)
        await pager.start()
        evictions = _counter(metrics.PAGING_EVICTIONS, "disk")
        for n in names:
            await pager.ensure(specs[n])
        assert specs["lora_a"].digest not in pager.resident("disk")
        assert not (tmp_path / "disk" / specs["lora_a"].digest).exists()
        assert _counter(metrics.PAGING_EVICTIONS, "disk") == evictions + 1
        total = sum(p.stat().st_size for d in pager.resident("disk") for p in (tmp_path / "disk" / d).iterdir())
        assert total <= pager._disk.max_bytes
        downloads = make.blobs.total
        await pager.ensure(specs["lora_a"])  # gone from disk: fetched again
        assert make.blobs.total == downloads + len(specs["lora_a"].files)

    asyncio.run(scenario())


def test_restart_rebuilds_the_disk_index(make, specs):
    async def scenario():
        first = make()
        await first.start()
        await first.ensure(specs["lora_b"])
        await first.ensure(specs["direft_b"])
        downloads = make.blobs.total
        second = make()
        await second.start()
        assert set(second.resident("disk")) == {specs["lora_b"].digest, specs["direft_b"].digest}
        await second.ensure(specs["direft_b"])
        await second.ensure(specs["lora_b"])
        assert make.blobs.total == downloads  # served from disk

    asyncio.run(scenario())


def test_s3_down_keeps_resident_adapters_serving(make, specs, store, s3_bucket):
    bogus = BlobStore(
        s3_bucket.settings(connect_timeout_s=0.5, read_timeout_s=1.0).model_copy(
            update={"endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    )

    class Switchable:
        """The real store until S3 'goes down'."""

        def __init__(self) -> None:
            self.target = store

        def download(self, digest: str, dest: Path) -> None:
            self.target.download(digest, dest)

    source = Switchable()

    async def scenario():
        pager = make(blobs=source)
        await pager.start()
        await pager.ensure(specs["lora_a"])
        await pager.ensure(specs["lora_b"])
        source.target = bogus
        async with pager.use(specs["lora_a"]) as path:  # resident: no S3 needed
            assert path.is_dir()
        await pager.ensure(specs["lora_b"])
        with pytest.raises(Unavailable, match="unavailable"):
            await pager.ensure(specs["lora_c"])  # cold
        assert specs["lora_c"].digest not in pager.resident("disk")

    asyncio.run(scenario())


def test_downloaded_files_are_the_registry_bytes(make, specs, adapters):
    spec = specs["lora_c"]

    async def scenario():
        pager = make()
        await pager.start()
        path = await pager.ensure(spec)
        for f in spec.files:
            assert hashlib.sha256((path / f.path).read_bytes()).hexdigest() == f.sha256
            assert (path / f.path).read_bytes() == (adapters["llama"]["lora_c"] / f.path).read_bytes()

    asyncio.run(scenario())
