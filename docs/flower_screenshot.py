"""Take a headless-Chromium screenshot of Flower's dashboard with a three-machine fleet.

    .venv/bin/python docs/flower_screenshot.py [OUT.png]

Starts a private Redis, the API and the workers of the embedded fleet (server, box1, box2),
runs a few jobs (one still queued behind a long one), starts `homefleet flower`, and saves
Flower's workers page as docs/flower-dashboard.png. Stops everything it started. Needs
Debian's `chromium` (apt-get install chromium).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.client import HomefleetClient
from app.context import build_context
from app.core.config import Settings
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port, start_redis_server
from app.devtools.tiny_models import make_tiny
from app.fleet.config import load_fleet, with_fresh_tokens

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,800",
]


def main(out: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="hf-flower-"))
    redis_server = start_redis_server(work / "redis")
    fleet = with_fresh_tokens(load_fleet(None))
    fleet_file = work / "fleet.toml"
    fleet_file.write_text(fleet.to_toml())
    settings = Settings(
        data_dir=work / "server",
        redis_url=redis_server.url,
        fleet_file=fleet_file,
        api_port=free_port(),
        api_keys=["flower-screenshot-key"],
    )
    ctx = build_context(settings, fleet, migrate=True)
    local = LocalFleet(settings, fleet, fleet_file)
    flower: subprocess.Popen[bytes] | None = None
    try:
        model = ctx.registry.add(make_tiny(work / "tiny")["txt2img"], model_id="tiny-sd").id
        for machine in fleet.machines:
            local.copy_model(model, machine)
        local.start_api()
        for machine in fleet.machines:
            local.start_worker(machine)
        local.wait_online(list(fleet.machines), model_id=model, timeout_s=180)
        port = free_port()
        env = {**os.environ, "HOMEFLEET_REDIS_URL": redis_server.url, "FLOWER_UNAUTHENTICATED_API": "true"}
        flower = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "flower", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        with HomefleetClient(local.api_url, api_key="flower-screenshot-key") as client:
            jobs = [
                client.submit(model, "txt2img", {"prompt": f"job {i}", "steps": 2}, target=m)
                for i, m in enumerate(["server", "box1", "box2", "box1", "auto"])
            ]
            for job in jobs:
                client.wait(job["id"], timeout_s=300)
            client.submit(model, "txt2img", {"prompt": "long", "steps": 200}, target="box2")
            client.submit(model, "txt2img", {"prompt": "waiting", "steps": 2}, target="box2")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(httpx.get(f"{url}/api/workers", params={"refresh": "true"}, timeout=10).json()) >= 3:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        time.sleep(3)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}", f"{url}/"],
                check=True,
                capture_output=True,
                timeout=120,
            )
        print(f"saved {out}")
    finally:
        if flower is not None:
            stop_process_group(flower)
        local.stop()
        ctx.close()
        redis_server.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("flower-dashboard.png")).resolve())
