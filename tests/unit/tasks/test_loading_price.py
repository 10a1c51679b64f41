"""The worker holds a resident model at the server's price of its variant (R15): the manifest's
``weights_bytes`` (priced once at registration, app/core/pricing.py), so the worker's residency
and placement's simulation of it (routing/finish.py) count the same bytes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from app.core.pricing import loaded_bytes
from app.core.protocol import Manifest
from app.core.variants import Variant
from residency.cache import ModelCache
from residency.device import MemoryKind
from routing.placement import SERVER
from tasks.loading import make_resident


class Cpu:
    memory_kind = MemoryKind.unified

    def available_bytes(self) -> int:
        return 10**12

    def place(self, pipeline: Any) -> Any:
        return pipeline

    def empty_cache(self) -> None:
        pass


def runtime(models_dir: Path) -> Any:
    cache = ModelCache(lambda folder, **kwargs: ("pipeline", folder, kwargs), Cpu(), capacity_bytes=10**9)
    return SimpleNamespace(
        settings=SimpleNamespace(machine=SERVER, models_dir=models_dir),
        cache=cache,
        record_warm=lambda: None,
        verified_stats={},
        withdraw=lambda model_id: None,
    )


def test_the_manifests_price_is_what_the_cache_holds(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    manifest = Manifest(model_id="m", family="sd1", kinds=["txt2img"], files=[], weights_bytes=123_456)
    make_resident(rt, manifest, working_bytes=1000)
    assert rt.cache.held_bytes() == 123_456


def test_an_older_servers_manifest_is_priced_by_the_same_function(tiny_models_dir: Path) -> None:
    rt = runtime(tiny_models_dir)
    manifest = Manifest(
        model_id="tiny-sd", family="sd1", kinds=["txt2img"], files=[], precision="bf16", quantization="torchao-int8wo"
    )
    make_resident(rt, manifest)
    assert rt.cache.held_bytes() == loaded_bytes(tiny_models_dir / "tiny-sd", Variant("bf16", "torchao-int8wo"))


def test_r5_a_copy_that_differs_names_the_fix_that_works_where_it_lies(tmp_path: Path) -> None:
    """A worker's copy is restored by a sync from the server; the server's own copy is what a
    sync copies from, so its worker names restoring the file or `models update` instead."""
    import pytest

    from app.core.digest import file_digest
    from app.core.errors import IntegrityFailure
    from app.core.protocol import ManifestFile

    (tmp_path / "m").mkdir()
    config = tmp_path / "m" / "config.json"
    config.write_text('{"a": 1}')
    digest = file_digest(config)
    config.write_text('{"a": 2}')  # the same size, other bytes
    manifest = Manifest(
        model_id="m",
        family="sd1",
        kinds=["txt2img"],
        files=[ManifestFile(path="config.json", size=config.stat().st_size, digest=digest)],
        weights_bytes=1,
    )
    said = {}
    for machine in (SERVER, "box1"):
        rt = runtime(tmp_path)
        rt.settings.machine = machine
        withdrawn: list[str] = []
        rt.withdraw = withdrawn.append
        with pytest.raises(IntegrityFailure) as caught:
            make_resident(rt, manifest)
        assert withdrawn == ["m"] and "config.json: digest" in str(caught.value)
        said[machine] = str(caught.value)
    assert "`homefleet models update m`" in said[SERVER] and "homefleet sync" not in said[SERVER]
    assert "(withdrawn until its files match again or `homefleet sync box1 m`)" in said["box1"]
